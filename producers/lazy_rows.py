"""Rows read on demand: a sequence (``len``, ``rows[i]``, ``rows[a:b]``) that decodes a row
only when asked for it, and knows where each row comes from for an error.

:class:`Rows` is what a task's rows are when they are not a list: the rows of one Arrow file
(producers/arrow_rows.py), of several files end to end (:class:`Concat`: a directory, the
sources of a mix), or a slice of either (:class:`RowRange`: an eval set's ``max_rows``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def missing(rows: Sequence[dict], field: str, start: int = 0, stop: int | None = None):
    """(first index, how many) of the rows in ``start:stop`` without ``field``; None if none."""
    if isinstance(rows, Rows):
        return rows.missing(field, start, len(rows) if stop is None else stop)
    lacking = [i for i in range(start, len(rows) if stop is None else stop) if field not in rows[i]]
    return (lacking[0], len(lacking)) if lacking else None


class Rows(Sequence):
    """Rows read on demand: ``len(rows)``, ``rows[i]`` (a new dict each time), ``rows[a:b]``
    (a view). A subclass gives :meth:`row`, :meth:`where` and, when it can do better than
    reading every row, :meth:`missing`."""

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, i: int) -> dict:
        """Row ``i``, 0 <= i < len."""
        raise NotImplementedError

    def where(self, i: int) -> str:
        """Where row ``i`` comes from, for an error: ``file:line`` or ``file row N``."""
        raise NotImplementedError

    def missing(self, field: str, start: int, stop: int) -> tuple[int, int] | None:
        """(first index, how many) of the rows in ``start:stop`` without ``field``."""
        lacking = [i for i in range(start, stop) if field not in self.row(i)]
        return (lacking[0], len(lacking)) if lacking else None

    def __getitem__(self, i):
        if isinstance(i, slice):
            span = range(len(self))[i]
            return RowRange(self, span) if span.step == 1 else [self.row(j) for j in span]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        return self.row(i % n)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {len(self)} rows>"


class RowRange(Rows):
    """Rows ``span`` of ``base`` (a slice of rows: the first ``eval.max_rows``)."""

    def __init__(self, base: Rows, span: range):
        self.base, self.span = base, span

    def __len__(self) -> int:
        return len(self.span)

    def row(self, i: int) -> dict:
        return self.base.row(self.span[i])

    def where(self, i: int) -> str:
        return self.base.where(self.span[i])

    def missing(self, field: str, start: int, stop: int) -> tuple[int, int] | None:
        found = self.base.missing(field, self.span.start + start, self.span.start + stop)
        return (found[0] - self.span.start, found[1]) if found else None


class Concat(Rows):
    """Sources' rows end to end: row ``i`` of part ``k`` is row ``offsets[k] + i``."""

    def __init__(self, parts: list[tuple[str, Sequence[dict]]]):
        if not parts:
            raise ValueError("no parts")
        self.labels = [label for label, _ in parts]
        self.parts = [rows for _, rows in parts]
        self.offsets = [0]
        for rows in self.parts:
            self.offsets.append(self.offsets[-1] + len(rows))

    def __len__(self) -> int:
        return self.offsets[-1]

    def _part(self, i: int) -> tuple[int, int]:
        k = bisect.bisect_right(self.offsets, i) - 1
        return k, i - self.offsets[k]

    def row(self, i: int) -> dict:
        k, j = self._part(i)
        return self.parts[k][j]

    def where(self, i: int) -> str:
        k, j = self._part(i)
        part = self.parts[k]
        return part.where(j) if isinstance(part, Rows) else f"{self.labels[k]} row {j}"

    def missing(self, field: str, start: int, stop: int) -> tuple[int, int] | None:
        first, count = None, 0
        for k, part in enumerate(self.parts):
            lo, hi = max(start, self.offsets[k]), min(stop, self.offsets[k + 1])
            if lo < hi and (found := missing(part, field, lo - self.offsets[k], hi - self.offsets[k])):
                first = self.offsets[k] + found[0] if first is None else first
                count += found[1]
        return (first, count) if count else None
