"""The producer's heartbeat thread: liveness in ``…:producers`` and renewal of every lease held.

A thread, not an anyio task: it must keep renewing while the event loop is busy (a long
blocking call in a rollout) so that leases expire only when the process is really gone.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

log = logging.getLogger(__name__)


class Heartbeat(threading.Thread):
    """ZADD ``…:producers`` {id: now} and renew the current lease every ``interval`` s."""

    def __init__(self, producer, interval: float):
        super().__init__(name=f"heartbeat-{producer.id}", daemon=True)
        self.producer, self.interval = producer, interval
        self._done = threading.Event()

    def run(self) -> None:
        p = self.producer
        while True:
            try:
                p.client.zadd(p.keys.producers, {p.id: time.time()})
                for ticket in list(p.held):
                    if not p.leases.renew(ticket):
                        # usually the lease just ended (published); a real loss is logged where
                        # it matters, when the group cannot be published
                        log.debug("lease on ticket %d is no longer ours", ticket)
            except redis.exceptions.RedisError as e:
                log.warning("heartbeat failed: %s", e)
            if self._done.wait(self.interval):
                return

    def close(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(timeout=5.0)
        try:
            self.producer.client.zrem(self.producer.keys.producers, self.producer.id)
        except redis.exceptions.RedisError as e:
            log.warning("could not remove heartbeat: %s", e)
