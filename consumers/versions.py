"""Publishing policy versions: write the weights, then announce them, off the step's path.

After a step the trainer hands the weights over and a writer thread does the slow part.
Weights on the CPU are lent, not copied: the writer reads them in place while the next
step's forward and backward passes run (which only read them too), and the learner waits
for :meth:`VersionPublisher.until_read` before its optimizer changes them. Others (on a GPU)
are copied to the CPU at once (a snapshot), so training goes on. In order, the writer
writes safetensors into ``{weights_dir}/v{version}`` (streamer.weights.write_version: temp
dir + rename), then runs one script that XADDs the :class:`WeightSync` to the policy stream
and SETs the version key — so nobody learns of a version before its files exist, and a
retried announcement adds no second copy — then prunes old versions. At most one version
waits while another is written; a slower writer holds the step loop back.
:meth:`VersionPublisher.drain` waits for everything handed over (before a checkpoint,
so a checkpoint never names a version that was never published, and at exit).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from redis.exceptions import ResponseError

from schemas import WeightSync, encode
from streamer import pieces, weights
from streamer.bus import FIELD
from streamer.config import BusSection
from streamer.connection import replicated, retrying
from streamer.errors import StreamerError
from streamer.keys import Keys
from streamer.values import wrong_type
from streamer.weights import WeightsCopy

log = logging.getLogger(__name__)

# XADD the WeightSync and SET the version key, unless that version (or a newer one) is
# announced already: version numbers are never reused, so a second announcement of the same
# version can only be a retry whose first reply was lost (redis-py re-sends a command after
# a timeout; so does `retrying`). 1 = added, 0 = already there. The stream keeps about the
# last POLICY_KEEP versions (or keep_versions, if more): readers want the newest (a late one
# reads only that), the trainer enough history for staleness after a restore.
# With a third key (the trainer's fence, streamer.trainer_lease) and its token as ARGV[5]:
# -1, having written nothing, when another trainer took the run since.
ANNOUNCE = """
if #KEYS == 3 then
  local fence = redis.call('GET', KEYS[3])
  if fence and fence ~= ARGV[5] then return -1 end
end
local current = tonumber(redis.call('GET', KEYS[2]) or '-1')
if current >= tonumber(ARGV[3]) and redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return 1
"""


POLICY_KEEP = 1000  # WeightSync entries kept on the policy stream (at least keep_versions)


def snapshot(model, spare: WeightsCopy | None = None) -> WeightsCopy:
    """A CPU copy of ``model``'s weights, written into ``spare``'s tensors when they fit (a
    snapshot the writer is done with): a fresh copy of a large model spends more time in page
    faults on new memory than in copying (~0.2 s against ~0.06 s for 390 MB here). The copy
    into ``spare`` is cut into slices copied on :data:`streamer.pieces.THREADS` threads."""
    if spare is not None and _refill(spare.state, model.state_dict()):
        return WeightsCopy(model, state=spare.state)
    return WeightsCopy(model)


def _on_cpu(model) -> bool:
    return all(t.device.type == "cpu" for t in model.state_dict().values())


_CHUNK = 1 << 22  # bytes one thread copies at a time


def _refill(target: dict, source: dict) -> bool:
    """Copy ``source`` into ``target``; False (nothing copied) unless both have the same
    names, shapes and dtypes, tied alike."""
    if target.keys() != source.keys():
        return False
    pairs: dict[int, int] = {}  # source storage -> target tensor: tied tensors are copied once
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, t in source.items():
        dst, key = target[name], t.data_ptr() if t.numel() else id(t)
        if dst.shape != t.shape or dst.dtype != t.dtype or dst.device.type != "cpu":
            return False
        if key in pairs:
            if pairs[key] != id(dst):
                return False
            continue
        if id(dst) in pairs.values():  # tied in the spare, not in the model
            return False
        pairs[key] = id(dst)
        copies += _slices(dst, t.detach())
    with torch.no_grad():  # copy_ releases the GIL
        pieces.on_threads(lambda pair: pair[0].copy_(pair[1]), copies)
    return True


def _slices(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs of at most about _CHUNK bytes covering ``src`` (whole unless both
    are contiguous)."""
    step = max(1, _CHUNK // max(1, src.element_size()))
    if src.numel() <= step or not (src.is_contiguous() and dst.is_contiguous()):
        return [(dst, src)]
    d, s = dst.view(-1), src.view(-1)
    return [(d[i : i + step], s[i : i + step]) for i in range(0, s.numel(), step)]


class VersionPublisher:
    def __init__(
        self,
        client,
        keys: Keys,
        *,
        root: Path,
        keep_versions: int,
        protect: Callable[[], int],
        bus: BusSection | None = None,
        dtype=None,
        untie: bool = False,
        fence=None,
    ):
        self.client, self.keys, self.root = client, keys, Path(root)
        self.dtype, self.untie = dtype, untie  # written as the samplers load them (weights.save)
        self.fence = fence  # the trainer's lease: an announcement checks its fencing token
        self.bus = bus or BusSection()
        self.keep_versions, self.protect = keep_versions, protect
        self.last_seconds = 0.0  # write + publish time of the newest published version
        self.give_up_after: float | None = None  # how long to wait out a server outage; None = forever
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._spare: WeightsCopy | None = None  # a published snapshot whose memory the next reuses
        self._error: BaseException | None = None
        self._read = threading.Event()  # set: no lent weights are left to read
        self._read.set()
        self._announce = client.register_script(ANNOUNCE)
        self._thread = threading.Thread(target=self._run, name="trainer-versions", daemon=True)
        self._thread.start()

    def publish_now(self, model, *, version: int, step: int) -> None:
        """Write and announce ``version`` synchronously (the restored weights at start)."""
        self.drain()
        self._write_and_announce(model, version, step)

    def submit(self, model, *, version: int, step: int) -> float:
        """Publish ``model``'s weights as ``version`` soon: lent when they are all on the CPU
        (they must not change before :meth:`until_read`), else a snapshot taken now; returns
        seconds blocked (waiting for the weights lent last, and for the snapshot)."""
        self._raise_if_failed()
        start = time.monotonic()
        self.until_read()  # the weights lent last: read before the step that made these
        own = not isinstance(model, weights.WeightsCopy)  # a caller's copy is the caller's
        if own and _on_cpu(model):
            self._read.clear()
            self._queue.put((model, version, step, False))  # lent: the trainer's own
        else:
            spare, self._spare = self._spare, None
            self._queue.put((snapshot(model, spare) if own else model, version, step, own))
        return time.monotonic() - start

    def until_read(self) -> None:
        """Block until the writer is done reading weights lent to it (then they may change)."""
        self._read.wait()

    def drain(self) -> None:
        """Block until every submitted version is published (raise if one failed)."""
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Publish what was submitted, then stop the writer thread."""
        try:
            self.drain()
        finally:
            self._queue.put(None)
            self._thread.join(30)

    def abandon(self, wait: float = 10.0) -> None:
        """Stop the writer after what it holds (the trainer is failing), waiting at most ``wait``
        seconds: a writer thread still inside torch or safetensors when the interpreter exits
        can end the process in std::terminate (SIGABRT) instead of the trainer's exit code."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            log.warning("version writer busy; leaving it behind")
            return
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("version writer still busy after %.0fs; leaving it behind", wait)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            copy, version, step, own = item
            try:
                if self._error is not None:
                    self._read.set()  # not written: lent weights may change
                else:
                    self._write_and_announce(copy, version, step)
                    if own:
                        self._spare = copy  # written and announced: the next snapshot's memory
            except BaseException as e:  # surfaced by the next submit/drain
                e = wrong_type(self.client, self.keys.types(), e) or e  # a key of another type, named
                if isinstance(e, StreamerError | ResponseError):  # a clear reason (disk full ...): one line
                    log.error("publishing version %d failed: %s", version, e)
                else:
                    log.exception("publishing version %d failed", version)
                self._error = e
            finally:
                self._queue.task_done()
        self._read.set()
        self._queue.task_done()

    def _write_and_announce(self, model, version: int, step: int) -> None:
        start = time.monotonic()
        try:  # checked as the bytes are written: samplers would only sample garbage
            uri, sha = weights.write_version(model, self.root, version, dtype=self.dtype, untie=self.untie)
        except weights.NonFinite as e:
            raise StreamerError(
                f"step {step} produced non-finite weights (tensor {e.tensor!r} holds inf or NaN); version "
                f"{version} is not published. Lower trainer.lr or check the data, then resume from the "
                "last checkpoint"
            ) from None
        finally:
            self._read.set()  # written: lent weights may change
        sync = WeightSync(version=version, step=step, uri=uri, sha256=sha)

        payload = encode(sync)
        # bounded: the weights kept, and enough history for staleness after a restore
        keep = max(self.keep_versions, POLICY_KEEP)

        def announce() -> int:
            keys, args = [self.keys.policy, self.keys.version], [FIELD, payload, version, keep]
            if self.fence is not None:
                keys, args = [*keys, self.fence.key], [*args, self.fence.token]
            added = self._announce(keys=keys, args=args)
            if added < 0:
                raise self.fence.fenced()
            # with bus.min_replicas: on a replica before anyone acts on it (a master that died
            # with it unreplicated would let a restarted trainer announce it again, other
            # weights under the same number); if that master dies meanwhile, the retry
            # announces again on the promoted replica (a copy already there is not repeated)
            # give_up_after: set when the trainer is stopping
            replicated(self.client, self.keys.replicated, self.bus, give_up_after=self.give_up_after)
            return added

        added = retrying(announce, what=f"publishing version {version}", give_up_after=self.give_up_after)
        if not added:  # our first try went through; its reply was lost
            log.info("version %d was already announced (a retry after a lost reply)", version)
        # never the version just announced (the newest), whatever the numbers on disk say
        weights.prune(self.root, self.keep_versions, protect=(self.protect(), version))
        self.last_seconds = time.monotonic() - start

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, StreamerError | ResponseError):  # the CLI prints it as one line, exit 1
            raise StreamerError(f"publishing a policy version failed: {self._error}") from self._error
        if self._error is not None:
            raise RuntimeError("publishing a policy version failed") from self._error
