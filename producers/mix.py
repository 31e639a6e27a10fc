"""Training rows from several sources, mixed by weight into one deterministic ticket order.

``[[dataset.sources]]`` lists sources with weights. Their rows are numbered end to end
(source ``s``'s row ``i`` is row ``offsets[s] + i`` of the task, and of the row records in
:mod:`streamer.rows`). An epoch is N tickets, N the number of rows of all sources, and
source ``s`` gets ``N * w_s / sum(w)`` of them (rounded to whole tickets, the remainders
to the largest fractions), so its share of the training follows its weight whatever its
size: a small source with a large weight is visited many times per epoch, a large one with
a small weight over several epochs. A source's tickets walk its rows in a seeded shuffle,
a new shuffle each pass, each epoch taking up the walk where the last one left it (so a
source drawn less than its size still reaches every row); the epoch's tickets of all
sources are then shuffled together (seeded by ``run.seed`` and the epoch).

The order is a function of the ticket alone, as :class:`~producers.dataset.Order` is: every
producer maps a ticket to the same row, and a restart from a checkpointed cursor
(:mod:`streamer.position`) resumes at the same place, as long as the sources, their sizes
and weights and the seed are the same. One source (or ``producer.dataset``) is the plain
:class:`~producers.dataset.Order`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from producers.dataset import Order, load_rows
from producers.lazy_rows import Concat
from streamer import demo
from streamer.config import RunConfig

CACHED_PASSES = 2  # shuffles kept per source: the pass an epoch ends in is where the next begins


def training_rows(cfg: RunConfig) -> Sequence[dict]:
    """The producers' rows: ``[[dataset.sources]]`` mixed (:class:`Mixed`), else ``producer.dataset``."""
    cache = cfg.dataset_cache_dir
    sources = cfg.dataset.sources
    if not sources:
        return load_rows(cfg.producer.dataset, cache_dir=cache)
    parts = [load_rows(s.dataset, split=s.split or "train", cache_dir=cache) for s in sources]
    if len(sources) == 1:
        return parts[0]  # a weight alone changes nothing
    return Mixed([(s.dataset, rows, s.weight) for s, rows in zip(sources, parts)])


def training_label(cfg: RunConfig) -> str:
    """What the training rows are called in messages and what picks the default reward:
    ``producer.dataset``, the one source, or the sources ("demo" when every one is the demo)."""
    sources = cfg.dataset.sources
    if not sources:
        return cfg.producer.dataset
    if len(sources) == 1:
        return sources[0].dataset
    if all(s.path == demo.DEMO for s in sources):
        return demo.DEMO
    return " + ".join(f"{s.dataset} (weight {s.weight:g})" for s in sources)


def order_of(rows: Sequence[dict], *, seed: int) -> Order:
    """The ticket order of ``rows``: weighted when they are :class:`Mixed`."""
    return rows.order(seed=seed) if isinstance(rows, Mixed) else Order(len(rows), seed=seed)


class Mixed(Concat):
    """Sources' rows end to end, with the weights their tickets are drawn by."""

    def __init__(self, sources: list[tuple[str, Sequence[dict], float]]):
        super().__init__([(label, rows) for label, rows, _ in sources])
        self.weights = [float(w) for _, _, w in sources]

    def order(self, *, seed: int) -> MixedOrder:
        return MixedOrder([len(rows) for rows in self.parts], self.weights, seed=seed)


def quotas(n: int, weights: Sequence[float]) -> np.ndarray:
    """``n`` split in proportion to ``weights``: whole numbers that sum to ``n``, the
    remainders going to the largest fractions (ties: the earlier source)."""
    w = np.asarray(weights, dtype=float)
    exact = n * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    extra = np.argsort(-(exact - out), kind="stable")[: n - int(out.sum())]
    out[extra] += 1
    return out


class MixedOrder(Order):
    """Tickets to rows of several sources, each source's share of an epoch by its weight."""

    def __init__(self, lengths: Sequence[int], weights: Sequence[float], *, seed: int):
        if len(lengths) != len(weights) or min(lengths, default=0) <= 0 or min(weights, default=0) <= 0:
            raise ValueError("every source needs rows and a weight > 0")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        super().__init__(int(self.lengths.sum()), seed=seed)
        self.quotas = quotas(self.n_rows, weights)
        self.shuffle_of = functools.lru_cache(maxsize=CACHED_PASSES * len(lengths))(self._shuffle_of)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The rows of epoch ``epoch``, position by position: each source's quota of its own
        walk, then all of them shuffled together."""
        drawn = [self.offsets[s] + self._walk(s, epoch, int(q)) for s, q in enumerate(self.quotas) if q]
        slots = np.concatenate(drawn).astype(np.uint32)
        return slots[np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)]

    def _walk(self, source: int, epoch: int, count: int) -> np.ndarray:
        """Steps ``epoch * count`` .. ``(epoch + 1) * count - 1`` of the source's walk over its
        rows, whose pass p is its p-th shuffle. The passes the epoch starts and ends in (which
        the epochs beside it share) are seeded by their number; the passes wholly inside it
        (the many of a small source drawn often) by the epoch, in one draw."""
        n = int(self.lengths[source])
        start, end = epoch * count, (epoch + 1) * count
        first, last = start // n, (end - 1) // n
        if first == last:
            return self.shuffle_of(source, first)[start - first * n : end - first * n]
        inner = np.tile(np.arange(n, dtype=np.uint32), (last - first - 1, 1))
        inner = np.random.default_rng([self.seed, source, epoch, 2]).permuted(inner, axis=1).ravel()
        head = self.shuffle_of(source, first)[start - first * n :]
        tail = self.shuffle_of(source, last)[: end - last * n]
        return np.concatenate([head, inner, tail])

    def _shuffle_of(self, source: int, p: int) -> np.ndarray:
        # a stream of its own: [seed, epoch] seeds the epochs' shuffles, [..., 2] the inner passes
        shuffle = np.random.default_rng([self.seed, source, p, 1]).permutation(int(self.lengths[source]))
        return shuffle.astype(np.uint32)
