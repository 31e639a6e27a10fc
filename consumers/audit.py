"""The version-stamp audit: re-score a sample of the trained groups under the versions their
tokens say sampled them.

Every sampled token carries the policy version that sampled it (``Sample.spans``), and the
importance correction trusts that stamp. A wrong one (a sampler that reloaded weights mid-
turn without saying so, or an engine that never really reloaded) goes unseen: ``mismatch_kl``
compares against the trainer's current weights, so on stale data it measures the lag too.

For a fraction ``trainer.audit_fraction`` of the accepted groups (chosen by a hash of the
group id: the same groups on every run and restart), the :class:`Auditor` loads each
stamped version's weights from the weights directory into a CPU float32 copy of the model
and computes, per sampled token t stamped version v,

    gap_t = | log p_v(x_t | x_<t) - sampler_t |      log p_v at the sampler's temperature

which is ~0 when the stamp is right (up to the engine's numerics: a half-precision engine
differs by its rounding, which ``mismatch_kl`` shows on fresh data as well). Versions gone
from disk (older than ``trainer.keep_versions``) and LoRA adapter versions are not scored:
their tokens are counted as unauditable. The files are the trainer's own (this process's,
or an earlier one's in the same data directory), so they are loaded as they are, without the
manifest check a sampler makes against the announcement (streamer/weights.py). The audit
runs in the step loop, on the CPU, after the step's training: ``audit_seconds``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from consumers import losses
from schemas import Sample, TrajectoryGroup
from streamer import lora, models, weights
from streamer.config import RunConfig
from streamer.errors import WeightsError

log = logging.getLogger(__name__)

MISMATCH_NATS = 0.01  # |gap| above which a token counts as mismatched
WARN_SHARE = 0.01  # mismatched share of a window's audited tokens that logs the warning
WARN_EVERY = 50  # trainer steps between two warnings (and the longest window)
LOGITS_BUDGET = 1 << 26  # floats of logits in one forward pass of the audit (256 MiB)


def chosen(group_id: str, fraction: float) -> bool:
    """Whether the group ``group_id`` is audited: its hash, as a number in [0, 1), is below
    ``fraction`` (reproducible across processes, unlike ``random``)."""
    digest = hashlib.blake2b(group_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


@torch.no_grad()
def completion_logprobs(model, samples: list[Sample], temperature: float = 1.0) -> list[np.ndarray]:
    """Each sample's (completion_len,) float32 log-probs of its completion tokens under
    ``model`` at ``temperature``, as the learner computes them (:func:`losses.token_logprobs`);
    the samples right-padded into one forward pass."""
    width = max(s.num_tokens for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)  # (B, T)
    attention = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : s.num_tokens] = torch.from_numpy(s.token_ids().astype(np.int64))
        attention[i, : s.num_tokens] = 1
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    logp = losses.token_logprobs(logits, ids[:, 1:], temperature)  # (B, T-1)
    return [logp[i, s.prompt_len - 1 : s.num_tokens - 1].numpy() for i, s in enumerate(samples)]


def chunks(samples: list[Sample], *, vocab: int, budget: int = LOGITS_BUDGET) -> list[list[Sample]]:
    """``samples`` in order, cut so that each chunk's padded logits (rows x width x vocab)
    stay within ``budget`` floats (a chunk of one sample may exceed it)."""
    out: list[list[Sample]] = []
    width = 0
    for s in samples:
        width = max(width, s.num_tokens)
        if out and (len(out[-1]) + 1) * width * vocab <= budget:
            out[-1].append(s)
        else:
            out.append([s])
            width = s.num_tokens
    return out


@dataclass
class Tally:
    """Audited tokens and their gaps, summed over some groups."""

    groups: int = 0
    tokens: int = 0
    mismatched: int = 0
    gap_sum: float = 0.0
    gap_max: float = 0.0
    unauditable: int = 0

    def add_gaps(self, gaps: np.ndarray) -> None:
        self.tokens += gaps.size
        self.mismatched += int((gaps > MISMATCH_NATS).sum())
        self.gap_sum += float(gaps.sum())
        self.gap_max = max(self.gap_max, float(gaps.max(initial=0.0)))

    def add(self, other: Tally) -> None:
        self.groups += other.groups
        self.tokens += other.tokens
        self.mismatched += other.mismatched
        self.gap_sum += other.gap_sum
        self.gap_max = max(self.gap_max, other.gap_max)
        self.unauditable += other.unauditable


class Auditor:
    """Re-scores the chosen groups of each trainer step; owns one CPU float32 model.

    ``build``: a model of the learner's architecture (its weights are replaced by each
    version's), called once, at the first version there is to load. ``temperature``: the
    learner's (the samplers' distribution).
    """

    def __init__(
        self,
        *,
        fraction: float,
        weights_dir: Path,
        build: Callable[[], torch.nn.Module],
        temperature: float = 1.0,
        warn_every: int = WARN_EVERY,
    ):
        self.fraction, self.root, self.build = fraction, Path(weights_dir), build
        self.temperature, self.warn_every = temperature, warn_every
        self.model: torch.nn.Module | None = None
        self.loaded: int | None = None  # the version in self.model
        self.total = Tally()
        self.last_step = Tally()  # the newest step that audited tokens: its gauges repeat until the next
        self._window = Tally()  # what the next warning reports: since the last, warn_every steps at most
        self.total = Tally()  # the whole run's (this process's)
        self._window_start: int | None = None
        self._warned_at: int | None = None

    @classmethod
    def of(cls, cfg: RunConfig, *, temperature: float) -> Auditor:
        """The trainer's: ``trainer.audit_fraction`` of its groups against its weights directory,
        on a CPU copy of ``model``; off where it cannot tell a wrong stamp: with
        ``producer.top_p < 1`` every sampler log-prob is nucleus-renormalised (producers/samplers.py)."""
        fraction = cfg.trainer.audit_fraction
        if fraction > 0 and cfg.producer.top_p < 1:
            log.info(
                "producer.top_p = %s: the version-stamp audit (trainer.audit_fraction) is off",
                cfg.producer.top_p,
            )
            fraction = 0.0
        return cls(
            fraction=fraction,
            weights_dir=cfg.weights_dir,
            build=lambda: models.load_model(cfg.model, seed=cfg.run.seed, dev="cpu"),
            temperature=temperature,
        )

    def summary(self) -> str:
        """One line on the whole run's audit ("" when it audited nothing)."""
        t = self.total
        if not t.tokens:
            return ""
        return (
            f"version stamps audited over the run: {t.tokens:,} tokens of {t.groups:,} groups, "
            f"max gap {t.gap_max:.3g} nats, {t.mismatched:,} off by > {MISMATCH_NATS:g}"
        )

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    def audit(self, groups: Iterable[TrajectoryGroup], *, step: int) -> dict[str, float]:
        """Audit the chosen ones of ``groups`` (trained at trainer step ``step``); the step's
        metric values ({} when the audit is off)."""
        if not self.enabled:
            return {}
        t0 = time.monotonic()
        tally = Tally()
        picked = [g for g in groups if chosen(g.group_id, self.fraction)]
        tally.groups = len(picked)
        by_version: dict[int, list[tuple[Sample, np.ndarray]]] = {}
        for g in picked:
            for s in g.samples:
                stamps = s.token_versions()
                for v in np.unique(stamps[stamps >= 0]).tolist():
                    by_version.setdefault(v, []).append((s, stamps == v))
        # the cached version first: one load fewer when consecutive steps share a version
        for v in sorted(by_version, key=lambda v: (v != self.loaded, v)):
            self._score(v, by_version[v], tally)
        self.total.add(tally)
        if tally.tokens:
            self.last_step = tally
        self._watch(tally, step)
        return self._values(tally, time.monotonic() - t0)

    def _score(self, version: int, stamped: list[tuple[Sample, np.ndarray]], tally: Tally) -> None:
        """Add the gaps of the tokens ``stamped`` (sample, its tokens stamped ``version``) to
        ``tally``, or count them unauditable."""
        if not self._load(version):
            tally.unauditable += sum(int(at.sum()) for _, at in stamped)
            return
        vocab = self.model.get_output_embeddings().weight.shape[0]
        samples = [s for s, _ in stamped]
        scores = [
            logp
            for chunk in chunks(samples, vocab=vocab)
            for logp in completion_logprobs(self.model, chunk, self.temperature)
        ]
        for (s, at), logp in zip(stamped, scores):
            tally.add_gaps(np.abs(logp[at] - s.sampler_logprobs()[at]))

    def _values(self, tally: Tally, seconds: float) -> dict[str, float]:
        last = self.last_step
        return {
            "audit_groups": float(tally.groups),
            "audit_tokens": float(tally.tokens),
            "audit_tokens_unauditable": float(tally.unauditable),
            "audit_logprob_gap_mean": last.gap_sum / max(last.tokens, 1),
            "audit_logprob_gap_max": last.gap_max,
            "audit_mismatched_token_share": last.mismatched / max(last.tokens, 1),
            "audit_seconds": seconds,
        }

    def _load(self, version: int) -> bool:
        """Put ``version``'s weights in the audit model; False (nothing to score) when its
        directory is gone (pruned), holds a LoRA adapter, or cannot be read."""
        if version == self.loaded:
            return True
        directory = weights.version_dir(self.root, version)
        if not directory.is_dir() or lora.is_adapter(directory):
            return False
        if self.model is None:
            self.model = self.build().float().to("cpu").eval().requires_grad_(False)
        self.loaded = None  # a load that fails half way leaves a mix of versions
        try:
            weights.load_into(self.model, directory)
        except (WeightsError, OSError) as e:  # pruned while read: the writer keeps keep_versions
            log.debug("audit: version %d not loaded: %s", version, e)
            return False
        self.loaded = version
        return True

    def _watch(self, tally: Tally, step: int) -> None:
        """Warn, at most once per ``warn_every`` steps, when more than :data:`WARN_SHARE` of the
        tokens audited since the last warning (at most ``warn_every`` steps back) are off."""
        if self._window_start is None:
            self._window_start = step
        w = self._window
        w.add(tally)
        self.total.add(tally)
        due = self._warned_at is None or step - self._warned_at >= self.warn_every
        if due and w.tokens and w.mismatched > WARN_SHARE * w.tokens:
            log.warning(
                "version stamps look wrong: %s of %s audited tokens (steps %d-%d) differ from their stamped "
                "version's log-prob by > %g nats (mean %.3g, max %.3g). Check producer.inflight_updates and "
                "that the engine really loads each version it reports; if every version differs alike, "
                "model.dtype and the engine's numerics (mismatch_kl on fresh data)",
                f"{w.mismatched:,}",
                f"{w.tokens:,}",
                self._window_start,
                step,
                MISMATCH_NATS,
                w.gap_sum / w.tokens,
                w.gap_max,
            )
            self._warned_at = step
        elif step - self._window_start + 1 < self.warn_every:
            return
        elif w.tokens:  # a window that looked right: say so, with its figure
            log.info(
                "version stamps audited: %s tokens (steps %d-%d), max gap %.3g nats, %s off by > %g",
                f"{w.tokens:,}",
                self._window_start,
                step,
                w.gap_max,
                f"{w.mismatched:,}",
                MISMATCH_NATS,
            )
        self._window, self._window_start = Tally(), None
