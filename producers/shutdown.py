"""A producer process's stop: SIGTERM/SIGINT end its loop after the rows in flight.

Rows in flight are finished if they can be within ``producer.shutdown_grace`` seconds;
past that they are handed back (requeued first) and the process exits 0 at once. A second
signal stops at once (:mod:`streamer.lifecycle`'s rule): the leases expire instead.
"""

from __future__ import annotations

import logging
import os
import threading

import redis

from streamer import lifecycle

log = logging.getLogger(__name__)


def on_signals(producer) -> dict:
    """SIGTERM/SIGINT stop ``producer`` (a :class:`~producers.producer.Producer`) after the
    current rows; past the grace period they are handed back (module docstring)."""
    grace = producer.producer_cfg.shutdown_grace

    def arm_grace() -> None:
        timer = threading.Timer(grace, _give_up, args=(producer,))
        timer.daemon = True  # a loop that ends in time exits without waiting for it
        timer.start()

    doing = f"finishing the current row (grace {grace:.0f}s)"
    return lifecycle.on_stop_signals(producer.stop, f"producer {producer.id}", doing, then=arm_grace)


def _give_up(producer) -> None:
    """The grace period passed: hand the rows back and leave now (exit 0: a clean stop)."""
    held = sorted(producer.held)
    try:
        for ticket in held:
            if producer.leases.hand_back(ticket):
                log.warning("grace period over: ticket %d handed back", ticket)
        producer.client.zrem(producer.keys.producers, producer.id)
    except redis.exceptions.RedisError as e:
        log.error("grace period over; could not hand back tickets %s: %s", held, e)
    logging.shutdown()
    os._exit(0)
