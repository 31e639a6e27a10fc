"""Dataset rows: a JSONL file of prompts (or the built-in demo), and its per-epoch order.

One JSON object per line, with either ``messages`` (a chat: a list of ``{"role",
"content"}``) or ``prompt`` (a string), plus whatever the reward needs (e.g. ``answer``).
Blank lines are skipped; anything else that is not such an object is a
:class:`DatasetError` naming the file and line, raised before any work starts.

Rows are handed out by global *tickets* (see :mod:`streamer.admission`): ticket ``t`` is
position ``t % N`` of epoch ``t // N``, and each epoch visits the rows in its own seeded
shuffle, so every producer maps a ticket to the same row without talking to the others.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer import demo
from streamer.errors import DatasetError

CACHED_ROWS = 1 << 16  # row indices the cached permutations hold at most (4 epochs at least)


def load_rows(source: str, *, split: str = "train") -> list[dict]:
    """Rows of ``source``: "demo" (the built-in task's ``split``) or a JSONL path."""
    if source == demo.DEMO:
        return demo.rows(split)
    if source.startswith(f"{demo.DEMO}:"):  # a built-in multi-turn task (streamer.rollout.tasks)
        from streamer.rollout import tasks

        return tasks.rows(source.partition(":")[2], split)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    lines = enumerate(text.splitlines(), start=1)
    rows = [parse_row(line, where=f"{path}:{lineno}") for lineno, line in lines if line.strip()]
    if not rows:
        raise DatasetError(f"{path}: no rows (expected one JSON object per line)")
    return rows


def parse_row(line: str, *, where: str) -> dict:
    """One JSONL line as a row dict, or a DatasetError that starts with ``where``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        _check_messages(row["messages"], where)
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DatasetError(f"{where}: `prompt` must be a non-empty string")
    else:
        raise DatasetError(f"{where}: a row needs `messages` (a chat) or `prompt` (a string)")
    return row


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: `messages` must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DatasetError(f"{where}: messages[{i}] needs a string `role`")
        if not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: messages[{i}] needs a string `content`")


def check_required(rows: list[dict], fields, *, source: str, reward: str) -> None:
    """Every row has the fields the reward reads (its ``required_fields``), or a DatasetError
    before any work starts: such a row could never be scored, so never trained."""
    for field in fields:
        missing = [i for i, row in enumerate(rows) if field not in row]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise DatasetError(
                f"{source}: row {missing[0]}{more} has no `{field}`, which the reward {reward} needs"
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
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
