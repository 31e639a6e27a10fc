"""The metric names each axis publishes in ``MetricsEvent.values`` (part of the contract).

The exporter serves ``streamer_{axis}_{name}`` for every name here; ``counter`` values are
per-event increments it sums into ``streamer_{axis}_{name}_total``, ``gauge`` values are
the latest reading. Names use base units (seconds, ratios 0-1). Names not listed are still
exported (sanitised) but dashboards may only use listed ones.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["gauge", "counter"]

# why a producer dropped an episode (see producers.episodes.REASONS)
EPISODE_DROP_REASONS = (
    "error",
    "timeout",
    "malformed",
    "bad_token",
    "bad_logprob",
    "too_long",
    "too_many_forks",
    "bad_reward",
)
# how many versions behind the trained policy a trained token's sampling version was
TOKENS_BEHIND = ("0", "1", "2", "3_or_more")
REJECT_REASONS = ("stale", "zero_variance", "too_few_samples", "overlong", "user_filter", "too_long")


def _axis(*, gauges: dict[str, str], counters: dict[str, str] | None = None) -> dict[str, tuple[Kind, str]]:
    """One axis's catalog: name -> (kind, what it measures)."""
    return {name: ("gauge", what) for name, what in gauges.items()} | {
        name: ("counter", what) for name, what in (counters or {}).items()
    }


TRAIN = _axis(
    gauges={
        "loss": "total loss of the step",
        "policy_loss": "PPO policy loss",
        "kl": "k3 KL to the reference model",
        "entropy": "mean token entropy of the policy on trained tokens",
        "clip_fraction": "ratio of trained tokens whose PPO ratio was clipped",
        "clip_low_fraction": "ratio of trained tokens clipped at the lower bound (A < 0)",
        "clip_high_fraction": "ratio of trained tokens clipped at the upper bound (A > 0, or dual clip)",
        "ratio_mean": "mean ratio of current to proximal policy on trained tokens",
        "ppo_kl": "k3 KL(proximal || current) on trained tokens: how far the updates moved",
        "mismatch_kl": "k3 KL(sampler || trainer) on trained tokens: inference/training mismatch",
        "is_weight_mean": "mean truncated importance weight",
        "is_weight_max": "max importance weight before truncation",
        "proximal_forward_seconds": "time of the step's proximal log-prob forward passes",
        "reference_forward_seconds": "time of the step's reference-model forward passes",
        "forward_backward_seconds": "time of the step's forward and backward passes",
        "optimizer_seconds": "time of the step's grad clipping and optimizer updates",
        "response_length_mean": "mean completion tokens of the trained samples",
        "response_length_max": "max completion tokens of the trained samples",
        "grad_norm": "global gradient norm before clipping",
        "lr": "learning rate of the step's last optimizer step",
        "tokens_per_second": "trained tokens per second of step time",
        "step_seconds": "wall time of the trainer step (ppo_minibatches optimizer steps)",
        "data_wait_seconds": "time the step waited for data",
        "staleness_mean": "mean version lag of the batch's groups",
        "staleness_max": "max version lag of the batch's groups",
        "reward_mean": "mean reward of the trained groups",
        "version": "policy version after the step",
        "weight_sync_seconds": "time to write and publish the new weights",
        # the version-stamp audit (consumers/audit.py), when trainer.audit_fraction > 0; its
        # gauges are of the newest step that audited tokens, repeated until the next one
        "audit_logprob_gap_mean": "mean |stamped version's log-prob - sampler's| of audited tokens",
        "audit_logprob_gap_max": "max |stamped version's log-prob - sampler's| of audited tokens",
        "audit_mismatched_token_share": "ratio of audited tokens whose log-prob gap is above 0.01",
        "audit_seconds": "time of the step's version-stamp audit",
    },
    counters={
        "groups_accepted": "groups trained",
        "optimizer_steps_skipped": "optimizer steps skipped for a non-finite gradient",
        "steps_skipped": "trainer steps that changed no weights: every update's gradient was not finite",
        "groups_skipped": "groups of skipped trainer steps (dead-lettered, not trained)",
        "tokens": "trained tokens",
        "audit_groups": "groups re-scored under their stamped versions",
        "audit_tokens": "sampled tokens re-scored under their stamped versions",
        "audit_tokens_unauditable": "audited groups' sampled tokens whose version is gone from disk (or an adapter)",
        **{f"groups_rejected_{r}": f"groups rejected: {r.replace('_', ' ')}" for r in REJECT_REASONS},
        **{
            f"tokens_behind_{k}": f"trained sampled tokens whose sampling version was {k.replace('_', ' ')} "
            "versions behind the policy trained"
            for k in TOKENS_BEHIND
        },
    },
)

ROLLOUT = _axis(
    gauges={
        "reward_mean": "mean reward of the group",
        "accuracy": "ratio of samples with reward > 0",
        "response_length_mean": "mean completion tokens",
        "response_length_min": "min completion tokens",
        "response_length_max": "max completion tokens",
        "truncated_ratio": "ratio of samples stopped by the length cap",
        "policy_version": "oldest policy version that sampled the group",
        "version_offset": "current version minus the version that sampled the group",
        "sample_seconds": "time to sample the group",
        "admission_wait_seconds": "time the group waited for an admission slot",
        "backpressure_wait_seconds": "time publishing waited for the trainer",
        "weight_load_seconds": "time to load the newest weights",
        "turns_mean": "mean sampled turns per episode of the group",
        "episode_seconds": "wall time of the group's rollout",
        "in_flight_episodes": "rows in flight in the producer when the group was published",
        "rows_active": "dataset rows not set aside (they may still teach)",
        "rows_solved": "rows set aside as solved: their last groups were all (or mostly) solved",
        "rows_unsolvable": "rows set aside: their last groups taught nothing, most failed",
        "nothing_to_teach": "1 once every row is solved and the producers stopped",
    },
    counters={
        "groups": "groups published",
        "samples": "samples published",
        "tokens": "completion tokens published",
        "sample_failures": "samples whose reward function raised",
        "groups_dropped": "groups not published: fewer than min_group_size good samples",
        "weight_loads": "weight versions loaded",
        "weight_load_errors": "weight versions that could not be loaded",
        "tool_calls": "tool calls made by published episodes",
        "prefix_mismatches": "rollouts dropped: an engine call broke the token prefix",
        "proxy_divergences": "agent calls through the proxy that re-tokenized an earlier turn",
        "episode_forks": "extra samples of episodes whose history stopped extending their tokens (each piece trained once)",
        "rows_passed_over": "tickets of rows set aside that claims passed over",
        **{f"episodes_dropped_{r}": f"episodes dropped: {r.replace('_', ' ')}" for r in EPISODE_DROP_REASONS},
    },
)

DEFAULT_EVAL_SET = "default"  # the eval set of the [eval] keys, and of an event that names none

# one event per eval set (MetricsEvent.eval_set); the exporter labels these with `set`
EVAL = _axis(
    gauges={
        "reward_mean": "mean reward of the set's samples",
        "accuracy": "ratio of the set's samples that succeed (greedy: of rows); equals mean_at_k",
        "mean_at_k": "ratio of a row's k samples that succeed, averaged over rows (mean@k)",
        "pass_at_k": "unbiased pass@k: chance that k of a row's samples hold a success, row mean",
        "response_length_mean": "mean completion tokens",
        "rows": "rows evaluated",
        "k": "the k of pass@k (samples per row; 1 = greedy)",
        "samples": "completions sampled per row (n >= k)",
        "eval_seconds": "time the evaluation of the set took",
    },
)

AXES: dict[str, dict[str, tuple[Kind, str]]] = {"train": TRAIN, "rollout": ROLLOUT, "eval": EVAL}
