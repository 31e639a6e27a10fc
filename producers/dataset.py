"""Dataset rows: where they come from, the rule every row keeps, and their per-epoch order.

A source (``producer.dataset``, an eval set's ``dataset``, or each ``[[dataset.sources]]``):

- ``demo`` or ``demo:TASK``: the built-in rows, in memory;
- ``reasoning_gym:NAME`` or ``verifiers:ENV_ID``: an environment's rows (:mod:`producers.envs`);
- a JSONL file: one JSON object per line, blank lines skipped;
- a parquet or Arrow file, a directory of such files (and JSONL), or a hub dataset
  ``hf:owner/name[/config][:split]``: read through HF ``datasets`` (the ``datasets``
  extra), memory-mapped, a row decoded only when a ticket points at it
  (:mod:`producers.arrow_rows`). A JSONL file goes that way too when ``datasets`` is
  installed; without it, it is read whole into memory.

Every row has ``messages`` (a chat: a list of ``{"role", "content"}``) or ``prompt`` (a
string) (:mod:`producers.row_rule`), plus whatever the reward needs (its ``required_fields``,
e.g. ``answer``). A row that breaks this is a :class:`DatasetError` naming the file and line
(or row) and raised before any work starts, as is a row without a field the reward needs
(:func:`check_required`). Rows that are not a list are :class:`~producers.lazy_rows.Rows`.

Rows are handed out by global *tickets* (see :mod:`streamer.admission`): ticket ``t`` is
position ``t % N`` of epoch ``t // N``, and each epoch visits the rows in its own seeded
shuffle, so every producer maps a ticket to the same row without talking to the others.
Several weighted sources have an order of their own (:mod:`producers.mix`).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from producers import envs
from producers.lazy_rows import Rows, missing
from producers.row_rule import read_jsonl
from streamer import demo
from streamer.config_dataset import HUB
from streamer.errors import DatasetError

CACHED_ROWS = 1 << 16  # row indices the cached permutations hold at most (4 epochs at least)
EVAL_SPLIT = {"eval": "test"}  # a hub dataset's split for an eval set whose name gives none


def load_rows(source: str, *, split: str = "train", cache_dir: str | Path | None = None) -> Sequence[dict]:
    """Rows of ``source`` (see the module's docstring), checked against the row rule.

    ``split``: the demo's split, and a hub dataset's when its name gives none ("eval" asks
    the hub for "test"). ``cache_dir``: where ``datasets`` keeps its Arrow conversions
    (None: its own cache)."""
    if source == demo.DEMO:
        return demo.rows(split)
    if source.startswith(f"{demo.DEMO}:"):  # a built-in multi-turn task (streamer.rollout.tasks)
        from streamer.rollout import tasks

        return tasks.rows(source.partition(":")[2], split)
    if envs.is_source(source):  # reasoning_gym:NAME, verifiers:ENV_ID (producers.envs)
        return envs.rows(source, split)
    if source.startswith(HUB):
        return _arrow(source).load_hub(source, split=EVAL_SPLIT.get(split, split), cache_dir=cache_dir)
    path = Path(source)
    if path.is_dir() or path.suffix in (".parquet", ".arrow"):
        return _arrow(source).load_path(path, cache_dir=cache_dir)
    if has_datasets():
        from producers import arrow_rows

        return arrow_rows.load_path(path, cache_dir=cache_dir)
    return read_jsonl(path)


def has_datasets() -> bool:
    """Whether HF ``datasets`` is installed (the ``datasets`` extra)."""
    return importlib.util.find_spec("datasets") is not None


def _arrow(source: str):
    if not has_datasets():
        raise DatasetError(
            f"{source}: reading parquet, Arrow, directories and hub datasets needs HF datasets: "
            "pip install 'streamer-rl[datasets]'"
        )
    from producers import arrow_rows

    return arrow_rows


def check_required(rows: Sequence[dict], fields, *, source: str, reward: str) -> None:
    """Every row has the fields the reward reads (its ``required_fields``), or a DatasetError
    before any work starts: such a row could never be scored, so never trained."""
    for field in fields:
        found = missing(rows, field)
        if found:
            first, count = found
            where = rows.where(first) if isinstance(rows, Rows) else ""
            at = f" (row {first} is {where})" if where and where != f"{source} row {first}" else ""
            more = f" (and {count - 1} more)" if count > 1 else ""
            raise DatasetError(
                f"{source}: row {first}{more} has no `{field}`, which the reward {reward} needs{at}"
            )


@dataclass(frozen=True, slots=True)
class Position:
    """Where a ticket points: epoch, and the dataset row index within it."""

    ticket: int
    epoch: int
    row: int


class Order:
    """Maps global tickets to (epoch, row): a seeded permutation per epoch."""

    def __init__(self, n_rows: int, *, seed: int, shuffle: bool = True):
        if n_rows <= 0:
            raise ValueError("a dataset needs at least one row")
        self.n_rows, self.seed, self.shuffle = n_rows, seed, shuffle
        # a claim's window of tickets spans many epochs of a small dataset: keep them all
        self.permutation = functools.lru_cache(maxsize=max(4, CACHED_ROWS // n_rows))(self._permutation)

    def position(self, ticket: int) -> Position:
        epoch, i = divmod(ticket, self.n_rows)
        row = int(self.permutation(epoch)[i]) if self.shuffle else i
        return Position(ticket=ticket, epoch=epoch, row=row)

    def window(self, start: int, n: int) -> bytes:
        """The rows of tickets ``start`` .. ``start + n - 1``, as little-endian uint32."""
        parts, ticket = [], max(0, start)
        while ticket < start + n:
            epoch, i = divmod(ticket, self.n_rows)
            take = min(self.n_rows - i, start + n - ticket)
            rows = self.permutation(epoch)[i : i + take] if self.shuffle else np.arange(i, i + take)
            parts.append(rows.astype("<u4").tobytes())
            ticket += take
        return b"".join(parts)

    def total_tickets(self, epochs: int) -> int | None:
        """Tickets in ``epochs`` epochs; None when unbounded (epochs == 0)."""
        return self.n_rows * epochs if epochs > 0 else None

    def _permutation(self, epoch: int) -> np.ndarray:
        """The rows of epoch ``epoch``, position by position (uint32: 4 bytes a row)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows).astype(np.uint32)
