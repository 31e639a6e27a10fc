"""Follow the policy stream: load the newest WeightSync before the next group.

The newest entry of ``…:policy`` is the current policy. Before each group the producer
asks :meth:`WeightFollower.update` to load it if it is newer than what the sampler has:
the uri must lie inside ``weights_dir`` and the directory's manifest must hash to the
announced sha256 and list every file at its size (:func:`streamer.weights.resolve`; with
``weights.verify = "full"`` every piece is re-hashed too), then the sampler loads it (in
place for a local model; a reload request for a server). Floating tensors are cast to the
sampler's dtype; a tensor holding inf or NaN is refused before anything is copied.

A version that cannot be loaded is logged, counted and reported (streamer/problems.py);
it is tried again after a short backoff, or a newer version instead. Meanwhile sampling
continues with the weights the sampler has, and the samples keep that older version
stamp (the trainer's staleness window decides whether they still train). After
:data:`MAX_LOAD_FAILURES` failed loads in a row the follower raises
:class:`~streamer.errors.WeightsError` naming the file and the reason: a process that
cannot follow the policy stops rather than sample a version that only gets older. An
engine that cannot be reached while reloading is an outage (the caller waits it out),
not a failed load.

No WeightSync yet means version 0: the initial weights built from the model config.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import redis

from producers.reload import ServerVersions
from schemas import WeightSync
from streamer import lora, problems, weights
from streamer.config import RunConfig
from streamer.errors import SamplerError, StreamerError, WeightsError
from streamer.keys import Keys
from streamer.tail import Tail

log = logging.getLogger(__name__)

MAX_LOAD_FAILURES = 3  # failed loads in a row (any versions) before the process gives up
RETRY_SECONDS = 1.0  # backoff before a failed version is tried again (doubled each time)


class WeightFollower:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        weights_dir: Path,
        sampler,
        verify: str = "manifest",
        who: str = "",
        inflight_updates: str = "drain",
    ):
        self.client, self.keys, self.who = client, keys, who  # who: the role, in status's problems
        self.tail = Tail(client, keys.policy, as_type=WeightSync)
        self.verify = verify  # weights.resolve: "manifest" (same filesystem) or "full" re-hash
        self.weights_dir, self.sampler = Path(weights_dir), sampler
        self.version = 0  # policy version of the weights the sampler holds
        self.failures = 0  # failed loads since the last good one
        self.failed_version: int | None = None  # the last version that failed, retried at retry_at
        self.retry_at = 0.0  # time.monotonic()
        self.loads = self.errors = 0  # totals, for counters
        self.last_load_seconds: float | None = None
        # an engine that cannot load weights (producer.engine = "openai") keeps version 0
        self.follows = getattr(sampler, "follows_versions", True)
        if not self.follows:
            log.warning(
                "engine %r cannot load new weights: every sample is stamped with version 0, and the "
                "trainer drops them once they are older than trainer.max_staleness versions",
                getattr(getattr(sampler, "engine", None), "name", "?"),
            )
        # every process sampling one inference server updates it once per version, in order,
        # and knows which version sampled each token it gets (producers.reload)
        url = getattr(sampler, "base_url", None)
        self.shared = None
        if url:
            self.shared = ServerVersions(
                client,
                keys,
                url,
                lock_seconds=sampler.reload_deadline(),
                mode=inflight_updates,
                who=who,
            )
            sampler.attach(self.shared)

    @classmethod
    def of_run(cls, cfg: RunConfig, client: redis.Redis, sampler, *, who: str) -> WeightFollower:
        """The follower of run ``cfg``'s policy, with its weights directory and verification."""
        return cls(
            client,
            Keys(cfg.run.name),
            weights_dir=cfg.weights_dir,
            sampler=sampler,
            verify=cfg.weights.verify,
            who=who,
            inflight_updates=cfg.producer.inflight_updates,
        )

    def due(self, sync: WeightSync | None) -> bool:
        """Whether ``sync`` is newer than ours and not waiting out a failed load's backoff."""
        if sync is None or sync.version <= self.version or not self.follows:
            return False
        return sync.version != self.failed_version or time.monotonic() >= self.retry_at

    def update(self) -> bool:
        """Load the newest version if it is due; True when weights changed."""
        sync = self.tail.latest()
        return self.load(sync) if self.due(sync) else False

    def load(self, sync: WeightSync) -> bool:
        """Load ``sync`` now; False (logged, counted, reported) when it cannot be loaded.

        Raises WeightsError after MAX_LOAD_FAILURES failed loads in a row, and SamplerError
        when the engine cannot be reached (an outage, not the version's fault)."""
        if not self.follows:
            return False
        start = time.monotonic()
        try:
            path = weights.resolve(sync, self.weights_dir, verify=self.verify)
            if self.shared is None:
                self.sampler.load_weights(path)
                version = sync.version
            else:  # the version the server confirmed, which may be newer than sync's
                reloads = self.shared.reloads
                if lora.is_adapter(path):  # each request names its adapter: no in-flight protocol
                    version = self.shared.ensure(sync.version, lambda: self.sampler.load_weights(path))
                else:
                    version = self.shared.ensure(
                        sync.version, lambda: self.sampler.reload(path), engine=self.sampler
                    )
                adopt = getattr(self.sampler, "adopt", None)
                if self.shared.reloads == reloads and adopt is not None:  # another producer loaded it
                    adopt(weights.version_dir(self.weights_dir, version))
        except SamplerError as e:
            if not e.refused:
                raise  # the engine is unreachable: an outage, waited out by the caller
            self._failed(sync, e)
            return False
        except (StreamerError, OSError, RuntimeError, ValueError, KeyError) as e:
            self._failed(sync, e)
            return False
        self.last_load_seconds = time.monotonic() - start
        self.loads += 1
        log.info("loaded policy version %d in %.2fs", version, self.last_load_seconds)
        self.version = version
        if self.failures and self.who:
            problems.clear(self.client, self.keys, self.who)
        self.failures, self.failed_version = 0, None
        return True

    def _failed(self, sync: WeightSync, e: BaseException) -> None:
        self.errors += 1
        self.failures += 1
        what = f"cannot load policy version {sync.version} from {sync.uri}: {e}"
        if self.who:
            problems.report(self.client, self.keys, self.who, what)
        if self.failures >= MAX_LOAD_FAILURES:
            raise WeightsError(
                f"{what}; gave up after {self.failures} failed loads in a row (still on version {self.version})"
            ) from e
        delay = RETRY_SECONDS * 2 ** (self.failures - 1)
        self.failed_version, self.retry_at = sync.version, time.monotonic() + delay
        log.error("%s; keeping version %d, trying again in %.0fs", what, self.version, delay)
