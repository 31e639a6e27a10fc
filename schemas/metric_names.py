"""The metric names each axis publishes in ``MetricsEvent.values`` (part of the contract).

The exporter serves ``streamer_{axis}_{name}`` for every name here; ``counter`` values are
per-event increments it sums into ``streamer_{axis}_{name}_total``, ``gauge`` values are
the latest reading. Names use base units (seconds, ratios 0-1). Names not listed are still
exported (sanitised) but dashboards may only use listed ones.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["gauge", "counter"]

# why a producer dropped an episode (see producers.rollout.REASONS)
EPISODE_DROP_REASONS = ("error", "timeout", "malformed", "bad_token", "bad_logprob", "too_long", "bad_reward")
REJECT_REASONS = ("stale", "zero_variance", "too_few_samples", "overlong", "user_filter", "too_long")

TRAIN: dict[str, tuple[Kind, str]] = {
    "loss": ("gauge", "total loss of the step"),
    "policy_loss": ("gauge", "PPO policy loss"),
    "kl": ("gauge", "k3 KL to the reference model"),
    "entropy": ("gauge", "mean token entropy of the policy on trained tokens"),
    "clip_fraction": ("gauge", "ratio of trained tokens whose PPO ratio was clipped"),
    "clip_low_fraction": ("gauge", "ratio of trained tokens clipped at the lower bound (A < 0)"),
    "clip_high_fraction": (
        "gauge",
        "ratio of trained tokens clipped at the upper bound (A > 0, or dual clip)",
    ),
    "ratio_mean": ("gauge", "mean ratio of current to proximal policy on trained tokens"),
    "ppo_kl": ("gauge", "k3 KL(proximal || current) on trained tokens: how far the updates moved"),
    "mismatch_kl": ("gauge", "k3 KL(sampler || trainer) on trained tokens: inference/training mismatch"),
    "is_weight_mean": ("gauge", "mean truncated importance weight"),
    "is_weight_max": ("gauge", "max importance weight before truncation"),
    "proximal_forward_seconds": ("gauge", "time of the step's proximal log-prob forward passes"),
    "reference_forward_seconds": ("gauge", "time of the step's reference-model forward passes"),
    "forward_backward_seconds": ("gauge", "time of the step's forward and backward passes"),
    "optimizer_seconds": ("gauge", "time of the step's grad clipping and optimizer updates"),
    "response_length_mean": ("gauge", "mean completion tokens of the trained samples"),
    "response_length_max": ("gauge", "max completion tokens of the trained samples"),
    "grad_norm": ("gauge", "global gradient norm before clipping"),
    "lr": ("gauge", "learning rate of the step's last optimizer step"),
    "tokens_per_second": ("gauge", "trained tokens per second of step time"),
    "step_seconds": ("gauge", "wall time of the trainer step (ppo_minibatches optimizer steps)"),
    "data_wait_seconds": ("gauge", "time the step waited for data"),
    "staleness_mean": ("gauge", "mean version lag of the batch's groups"),
    "staleness_max": ("gauge", "max version lag of the batch's groups"),
    "reward_mean": ("gauge", "mean reward of the trained groups"),
    "version": ("gauge", "policy version after the step"),
    "weight_sync_seconds": ("gauge", "time to write and publish the new weights"),
    "groups_accepted": ("counter", "groups trained"),
    "optimizer_steps_skipped": ("counter", "optimizer steps skipped for a non-finite gradient"),
    "tokens": ("counter", "trained tokens"),
    **{
        f"groups_rejected_{r}": ("counter", f"groups rejected: {r.replace('_', ' ')}") for r in REJECT_REASONS
    },
}

ROLLOUT: dict[str, tuple[Kind, str]] = {
    "reward_mean": ("gauge", "mean reward of the group"),
    "accuracy": ("gauge", "ratio of samples with reward > 0"),
    "response_length_mean": ("gauge", "mean completion tokens"),
    "response_length_min": ("gauge", "min completion tokens"),
    "response_length_max": ("gauge", "max completion tokens"),
    "truncated_ratio": ("gauge", "ratio of samples stopped by the length cap"),
    "policy_version": ("gauge", "oldest policy version that sampled the group"),
    "version_offset": ("gauge", "current version minus the version that sampled the group"),
    "sample_seconds": ("gauge", "time to sample the group"),
    "admission_wait_seconds": ("gauge", "time the group waited for an admission slot"),
    "backpressure_wait_seconds": ("gauge", "time publishing waited for the trainer"),
    "groups": ("counter", "groups published"),
    "samples": ("counter", "samples published"),
    "tokens": ("counter", "completion tokens published"),
    "sample_failures": ("counter", "samples whose reward function raised"),
    "groups_dropped": ("counter", "groups not published: fewer than min_group_size good samples"),
    "weight_loads": ("counter", "weight versions loaded"),
    "weight_load_errors": ("counter", "weight versions that could not be loaded"),
    "weight_load_seconds": ("gauge", "time to load the newest weights"),
    "turns_mean": ("gauge", "mean sampled turns per episode of the group"),
    "tool_calls": ("counter", "tool calls made by published episodes"),
    "prefix_mismatches": ("counter", "rollouts dropped: an engine call broke the token prefix"),
    "proxy_divergences": ("counter", "agent calls through the proxy that re-tokenized an earlier turn"),
    "episode_forks": (
        "counter",
        "extra samples of episodes whose history stopped extending their tokens (each piece trained once)",
    ),
    "episode_seconds": ("gauge", "wall time of the group's rollout"),
    "in_flight_episodes": ("gauge", "rows in flight in the producer when the group was published"),
    "rows_active": ("gauge", "dataset rows not set aside (they may still teach)"),
    "rows_solved": ("gauge", "rows set aside: their last groups were all solved"),
    "rows_unsolvable": ("gauge", "rows set aside: their last groups all failed"),
    "rows_passed_over": ("counter", "tickets of rows set aside that claims passed over"),
    "nothing_to_teach": ("gauge", "1 once every row is solved and the producers stopped"),
    **{
        f"episodes_dropped_{r}": ("counter", f"episodes dropped: {r.replace('_', ' ')}")
        for r in EPISODE_DROP_REASONS
    },
}

DEFAULT_EVAL_SET = "default"  # the eval set of the [eval] keys, and of an event that names none

# one event per eval set (MetricsEvent.eval_set); the exporter labels these with `set`
EVAL: dict[str, tuple[Kind, str]] = {
    "reward_mean": ("gauge", "mean reward of the set's samples"),
    "accuracy": ("gauge", "ratio of the set's samples that succeed (greedy: of rows); equals mean_at_k"),
    "mean_at_k": ("gauge", "ratio of a row's k samples that succeed, averaged over rows (mean@k)"),
    "pass_at_k": ("gauge", "unbiased pass@k: chance that k of a row's samples hold a success, row mean"),
    "response_length_mean": ("gauge", "mean completion tokens"),
    "rows": ("gauge", "rows evaluated"),
    "k": ("gauge", "the k of pass@k (samples per row; 1 = greedy)"),
    "samples": ("gauge", "completions sampled per row (n >= k)"),
    "eval_seconds": ("gauge", "time the evaluation of the set took"),
}

AXES: dict[str, dict[str, tuple[Kind, str]]] = {"train": TRAIN, "rollout": ROLLOUT, "eval": EVAL}
