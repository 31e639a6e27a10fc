"""Stop signals: one rule for every role (streamer/lifecycle.py)."""

from __future__ import annotations

import os
import signal
import threading

from streamer import lifecycle


def test_the_first_stop_signal_is_graceful_and_the_second_is_not():
    """lifecycle.on_stop_signals: the first SIGTERM sets the stop event and runs ``then``; the
    handler that was there before comes back, so a second signal reaches it (for a role: the
    default action, which ends the process)."""
    stop, calls, before = threading.Event(), [], []
    outer = signal.signal(signal.SIGTERM, lambda *_: before.append("outer"))
    try:
        previous = lifecycle.on_stop_signals(stop, "test", then=lambda: calls.append("then"))
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread before kill returns
        assert stop.is_set() and calls == ["then"] and before == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == ["then"] and before == ["outer"], "the second signal went to the previous handler"
        lifecycle.restore_signals(previous)
    finally:
        signal.signal(signal.SIGTERM, outer)
