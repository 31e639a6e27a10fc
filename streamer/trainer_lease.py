"""One trainer per run, held on the server: the trainer lease and its fencing token.

The file lock in the run's directory (:mod:`streamer.rundir`) stops a second trainer that
shares the data dir; one started with another data dir (another machine, a typo) shares only
the server. So a trainer takes the run's lease when it starts (:meth:`TrainerLease.acquire`):
``…:trainer_lease`` (HASH owner, fence, holder) expires ``LEASE_SECONDS`` after its last
renewal, and a thread renews it while the trainer runs. The owner token belongs to the data
dir (:func:`streamer.rundir.trainer_id`): the same trainer restarted after a crash takes its
lease back at once; another one is refused with one line naming the holder while it is live.

Every acquisition increments ``…:trainer_fence``, the fencing token. The scripts that
acknowledge trajectory entries (:meth:`ack`, the rejections in
:meth:`streamer.admission.Admission.reject`) and announce a policy version
(:mod:`consumers.versions`) compare it with the trainer's own first, in the same script, so a
trainer whose run was taken over (it was paused past its lease, another one started, then it
resumed) can neither acknowledge nor publish: it stops with :class:`TrainerFenced`. A fence
key that is missing (the server lost the run's data) fences nobody; the renewal writes it back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

from streamer import rundir
from streamer.errors import StreamerError
from streamer.keys import Keys

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0  # a trainer that stopped renewing (killed, paused) holds the run this long
ACK_CHUNK = 1000  # entry ids per fenced XACK (a script's arguments are bounded)

# KEYS: lease fence ; ARGV: owner holder ttl_ms -> {1, fence} taken, {0, holder, ms left} refused
_ACQUIRE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then
  return {0, redis.call('HGET', KEYS[1], 'holder') or owner, redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'holder', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, fence}
"""

# KEYS: lease fence ; ARGV: owner fence holder ttl_ms -> 1 renewed, 0 taken over. A lease that
# expired while nobody took it (the fence is still ours) is taken again.
_RENEW = """
local fence = redis.call('GET', KEYS[2])
if fence and fence ~= ARGV[2] then return 0 end
if not fence then redis.call('SET', KEYS[2], ARGV[2]) end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', ARGV[2], 'holder', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: lease ; ARGV: fence
_GIVE_BACK = """
if redis.call('HGET', KEYS[1], 'fence') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# The first lines of every fenced script: KEYS[1] the fence key, ARGV[1] the caller's token;
# -1 when another trainer took the run since.
FENCE_CHECK = """
local fence = redis.call('GET', KEYS[1])
if fence and fence ~= ARGV[1] then return -1 end
"""

# KEYS: fence stream ; ARGV: fence group ids...
_ACK = FENCE_CHECK + "return redis.call('XACK', KEYS[2], ARGV[2], unpack(ARGV, 3))"


class TrainerFenced(StreamerError):
    """Another trainer took the run: this one may not acknowledge or publish any more."""


class TrainerLease:
    def __init__(self, client, keys: Keys, *, owner: str, holder: str, seconds: float = LEASE_SECONDS):
        self.client, self.keys, self.owner, self.holder, self.seconds = client, keys, owner, holder, seconds
        self.key = keys.trainer_fence  # what fenced scripts check
        self.token = ""  # our fence, once acquired
        self.lost = threading.Event()  # set when the renewal finds the run taken over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._give_back = client.register_script(_GIVE_BACK)
        self._ack = client.register_script(_ACK)

    @classmethod
    def of_run_dir(cls, client, keys: Keys, run_dir: Path) -> TrainerLease:
        """The lease of the trainer of ``run_dir`` (its owner token lives there)."""
        holder = f"pid {os.getpid()} on {socket.gethostname()}, data dir {Path(run_dir).parent}"
        return cls(client, keys, owner=rundir.trainer_id(run_dir), holder=holder)

    def acquire(self) -> int:
        """Take the run (a fresh fence) or raise StreamerError naming who holds it."""
        reply = self._acquire(
            keys=[self.keys.trainer_lease, self.keys.trainer_fence],
            args=[self.owner, self.holder, int(self.seconds * 1000)],
        )
        if int(reply[0]) != 1:
            holder, left = reply[1].decode(errors="replace"), max(int(reply[2]), 0) / 1000
            raise StreamerError(
                f"run {self.keys.run} is being trained by another trainer ({holder}); its lease "
                f"ends {left:.0f}s after it stops renewing it. One trainer per run: stop that one, "
                "or train under a new --run name"
            )
        self.token = str(int(reply[1]))
        log.info("trainer lease on run %s taken (fence %s)", self.keys.run, self.token)
        return int(reply[1])

    def renew(self) -> bool:
        """Extend the lease; False (and :attr:`lost` set) once another trainer took the run."""
        keys = [self.keys.trainer_lease, self.keys.trainer_fence]
        args = [self.owner, self.token, self.holder, int(self.seconds * 1000)]
        if int(self._renew(keys=keys, args=args)) == 1:
            return True
        if not self.lost.is_set():
            log.error("another trainer took run %s: this one stops without writing more", self.keys.run)
        self.lost.set()
        return False

    def start_renewing(self) -> None:
        """Renew every third of the lease in a daemon thread until :meth:`give_back`."""

        def run() -> None:
            while not self._stop.wait(self.seconds / 3) and not self.lost.is_set():
                try:
                    self.renew()
                except Exception as e:  # an outage: the lease may lapse; the fence still holds
                    log.warning("renewing the trainer lease failed (%s); retrying", e)

        self._thread = threading.Thread(target=run, name="trainer-lease", daemon=True)
        self._thread.start()

    def give_back(self) -> None:
        """Stop renewing and end the lease (if still ours): the next trainer need not wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.token and not self.lost.is_set():
            try:
                self._give_back(keys=[self.keys.trainer_lease], args=[self.token])
            except Exception as e:  # it expires on its own
                log.warning(
                    "could not give the trainer lease back (%s); it expires in %.0fs", e, self.seconds
                )

    def fenced(self) -> TrainerFenced:
        self.lost.set()
        return TrainerFenced(
            f"another trainer took run {self.keys.run} (its fence is newer than this trainer's "
            f"{self.token}): this trainer was paused or cut off past its lease; it stops here, "
            "having acknowledged and published nothing since"
        )

    def ack(self, stream: str, group: str, ids: list[str]) -> int:
        """XACK ``ids`` for ``group`` unless another trainer took the run (TrainerFenced)."""
        n = 0
        for i in range(0, len(ids), ACK_CHUNK):
            done = int(self._ack(keys=[self.key, stream], args=[self.token, group, *ids[i : i + ACK_CHUNK]]))
            if done < 0:
                raise self.fenced()
            n += done
        return n
