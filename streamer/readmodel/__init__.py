"""The read model of a run: what every reader of a run's state shares.

- :mod:`~streamer.readmodel.health`: :func:`snapshot`, the run's streams, policy,
  producers, rows and dead letters as the server holds them, and why it is stalled;
- :mod:`~streamer.readmodel.history`: :class:`History`, the run's curves as a bounded fold
  of metrics events;
- :mod:`~streamer.readmodel.saved`: the exporter's saved state (so the metrics stream can
  be trimmed), the window of event ids already folded, and :class:`Curves` /
  :func:`read_history`, the curves as of now (saved state plus the stream after it).

The metrics exporter, `streamer status`, `up`'s progress view and `streamer plot` all read
a run through these; none of them reads its keys another way.
"""

from streamer.readmodel.health import Snapshot, age, checkpoint_names, snapshot, stall_reasons
from streamer.readmodel.history import WINDOW, History
from streamer.readmodel.saved import Curves, SavedState, SeenIds, read_history

__all__ = [
    "WINDOW",
    "Curves",
    "History",
    "SavedState",
    "SeenIds",
    "Snapshot",
    "age",
    "checkpoint_names",
    "read_history",
    "snapshot",
    "stall_reasons",
]
