"""Follow the policy stream: load the newest WeightSync before the next group.

The newest entry of ``…:policy`` is the current policy. Before each group the producer
asks :meth:`WeightFollower.update` to load it if it is newer than what the sampler has:
the uri must lie inside ``weights_dir`` and the sha256 must match
(:func:`streamer.weights.resolve`: by the trainer's manifest, or every byte re-hashed with
``weights.verify = "full"``), then the sampler loads it (in place for a local
model; a reload request for a server). A version that cannot be loaded is logged,
counted and skipped for good; sampling continues with the weights the sampler has, and
the samples keep that older version stamp.

No WeightSync yet means version 0: the initial weights built from the model config.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import redis

from producers.reload import SharedReload
from schemas import WeightSync
from streamer import weights
from streamer.bus import Tail
from streamer.errors import StreamerError
from streamer.keys import Keys

log = logging.getLogger(__name__)


class WeightFollower:
    def __init__(
        self, client: redis.Redis, keys: Keys, *, weights_dir: Path, sampler, verify: str = "manifest"
    ):
        self.tail = Tail(client, keys.policy, as_type=WeightSync)
        self.verify = verify  # weights.resolve: "manifest" (same filesystem) or "full" re-hash
        self.weights_dir, self.sampler = Path(weights_dir), sampler
        self.version = 0  # policy version of the weights the sampler holds
        self.failed: set[int] = set()  # versions that could not be loaded (not retried)
        self.loads = self.errors = 0  # totals, for counters
        self.last_load_seconds: float | None = None
        # producers sharing one inference server reload it once per version, in order
        url = getattr(sampler, "base_url", None)
        self.shared = SharedReload(client, keys, url, lock_seconds=sampler.reload_deadline()) if url else None

    def update(self) -> bool:
        """Load the newest version if it is newer than ours; True when weights changed."""
        sync = self.tail.latest()
        if sync is None or sync.version <= self.version or sync.version in self.failed:
            return False
        return self.load(sync)

    def load(self, sync: WeightSync) -> bool:
        """Load ``sync`` now; False (logged, counted) when it cannot be loaded."""
        start = time.monotonic()
        try:
            path = weights.resolve(sync, self.weights_dir, verify=self.verify)
            if self.shared is None:
                self.sampler.load_weights(path)
                version = sync.version
            else:  # the version the server confirmed, which may be newer than sync's
                reloads = self.shared.reloads
                version = self.shared.ensure(sync.version, lambda: self.sampler.load_weights(path))
                adopt = getattr(self.sampler, "adopt", None)
                if self.shared.reloads == reloads and adopt is not None:  # another producer loaded it
                    adopt(weights.version_dir(self.weights_dir, version))
        except (StreamerError, OSError, RuntimeError, ValueError, KeyError) as e:
            self.failed.add(sync.version)
            self.errors += 1
            log.error("cannot load policy version %d (%s); keeping version %d", sync.version, e, self.version)
            return False
        self.last_load_seconds = time.monotonic() - start
        self.loads += 1
        log.info("loaded policy version %d in %.2fs", version, self.last_load_seconds)
        self.version = version
        return True
