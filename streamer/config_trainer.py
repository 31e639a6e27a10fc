"""The ``[trainer]`` section: the step, the optimizer, and the objective with each loss's keys."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from streamer.config_base import Fraction, NonNegFloat, NonNegInt, PosFloat, PosInt, Section


class DapoSection(Section):
    eps_low: NonNegFloat = 0.2  # (dapo) ratio >= 1 - eps_low
    eps_high: NonNegFloat = 0.28  # (dapo) ratio <= 1 + eps_high: clip-higher, wider than eps_low
    eps_clip_c: Annotated[float, msgspec.Meta(gt=1)] = (
        3.0  # (dapo) dual clip: a negative-advantage token's term is bounded at c*A
    )


class GspoSection(Section):
    eps_low: NonNegFloat = 3e-4  # (gspo) sequence ratio >= 1 - eps_low
    eps_high: NonNegFloat = 4e-4  # (gspo) sequence ratio <= 1 + eps_high


class CispoSection(Section):
    eps_low: NonNegFloat = 1.0  # (cispo) IS weight >= 1 - eps_low (1 = no lower bound)
    eps_high: NonNegFloat = 4.0  # (cispo) IS weight <= 1 + eps_high


class DroSection(Section):
    beta: NonNegFloat = 1.0  # (dro) weight of the quadratic penalty (logp - sampler logp)^2 / 2


Precision = Literal["auto", "float32", "bfloat16", "float16"]
LossAgg = Literal["auto", "token-mean", "seq-mean"]

# loss -> the trainer keys it reads (dotted: its own section); the config reference prints it.
# `trainer.loss` may also be "module:function", a loss of one's own (consumers/losses/terms.py)
LOSS_KEYS = {
    "grpo": ("tis_cap", "eps_low", "eps_high"),
    "dapo": ("tis_cap", "dapo.eps_low", "dapo.eps_high", "dapo.eps_clip_c"),
    "gspo": ("tis_cap", "gspo.eps_low", "gspo.eps_high"),
    "cispo": ("tis_cap", "cispo.eps_low", "cispo.eps_high"),
    "reinforce": ("tis_cap",),
    "importance_sampling": (),
    "dro": ("dro.beta",),
}
SEQ_MEAN_LOSSES = ("gspo",)  # losses whose objective is a sequence mean: loss_agg "auto" picks seq-mean
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo")


class TrainerSection(Section):
    groups_per_step: PosInt = 8  # accepted groups per trainer step
    max_staleness: NonNegInt = 1  # versions a group may lag the policy; 0 = synchronous on-policy
    steps: NonNegInt = 0  # stop after this many steps; 0 = forever
    lr: Annotated[float, msgspec.Meta(gt=0, le=1)] = (
        1e-5  # AdamW learning rate (an Adam step moves a weight by ~lr)
    )
    warmup_steps: NonNegInt = 0  # linear LR warmup, in optimizer steps
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup (consumers/schedule.py)
    lr_decay_steps: NonNegInt = 0  # optimizer steps from 0 to the end of decay; 0 = steps * ppo_minibatches
    min_lr_ratio: Fraction = 0.0  # the decayed LR's floor, as a fraction of lr
    weight_decay: NonNegFloat = 0.01  # AdamW weight decay
    grad_clip: PosFloat = 1.0  # max global grad norm
    max_skipped_steps: NonNegInt = (
        10  # steps in a row with every update skipped (non-finite gradient) that stop the trainer; 0 = never
    )
    ppo_minibatches: PosInt = 1  # optimizer steps per trainer step (the batch split in row slices)
    eps_low: NonNegFloat = 0.2  # PPO clip: ratio >= 1 - eps_low
    eps_high: NonNegFloat = 0.2  # PPO clip: ratio <= 1 + eps_high
    tis_cap: PosFloat = 5.0  # truncated importance weight cap against sampler log-probs
    kl_coef: NonNegFloat = 0.0  # k3 KL to the frozen initial model; 0 = no reference model
    loss_agg: LossAgg = "auto"  # auto = seq-mean for gspo (the paper's objective), token-mean otherwise
    std_normalize: bool = True  # divide advantages by the group std (floored)
    std_floor: PosFloat = 1e-4  # floor of the group std
    overlong: Literal["drop", "mask", "keep"] = "drop"  # samples truncated without EOS
    user_filter: str = ""  # import path of (group) -> bool; false rejects the group
    checkpoint_every: PosInt = 10  # steps between checkpoints (and at exit)
    keep_versions: PosInt = 3  # weight versions kept on disk
    audit_fraction: Fraction = 0.05  # share of groups re-scored under their stamped versions; 0 = off
    gradient_checkpointing: bool = False  # trade compute for memory
    fsdp: bool = False  # under torchrun: shard weights, grads and AdamW state over the ranks (FSDP2)
    min_group_size: PosInt = 2  # fewer samples (after dropping over-long ones) rejects the group
    micro_batch_size: NonNegInt = 0  # samples per forward/backward (grad accumulation); 0 = whole minibatch
    micro_batch_tokens: NonNegInt = (
        0  # tokens per forward/backward, samples bucketed by length (overrides micro_batch_size); 0 = off
    )
    keep_checkpoints: PosInt = 2  # full checkpoints kept; older ones keep only their audit metadata
    loss: str = "grpo"  # grpo, dapo, gspo, cispo, reinforce, importance_sampling, dro or module:function
    advantage: str = "grpo"  # grpo (z-score), dr_grpo (no std), rloo (leave one out) or module:function
    max_seq_len: NonNegInt = (
        0  # samples (prompt + completion) longer: dropped by producers, rejected here (too_long); 0 = off
    )
    precision: Precision = "auto"  # autocast dtype; auto = model.dtype if half; weights stay float32
    dapo: DapoSection = msgspec.field(default_factory=DapoSection)  # read when loss = "dapo"
    gspo: GspoSection = msgspec.field(default_factory=GspoSection)  # read when loss = "gspo"
    cispo: CispoSection = msgspec.field(default_factory=CispoSection)  # read when loss = "cispo"
    dro: DroSection = msgspec.field(default_factory=DroSection)  # read when loss = "dro"

    def __post_init__(self) -> None:
        if self.lr_schedule != "constant" and not (self.lr_decay_steps or self.steps):
            raise ValueError(
                f"`lr_schedule` = {self.lr_schedule!r} needs a length: set `lr_decay_steps` or `steps`"
            )
        if ":" not in self.advantage and "." not in self.advantage and self.advantage not in ADVANTAGE_NAMES:
            raise ValueError(
                f"`advantage` must be one of {', '.join(ADVANTAGE_NAMES)} or 'module:function', "
                f"got {self.advantage!r}"
            )
        if ":" not in self.loss and self.loss not in LOSS_KEYS:
            raise ValueError(
                f"`loss` must be one of {', '.join(LOSS_KEYS)} or 'module:function', got {self.loss!r}"
            )

    @property
    def aggregation(self) -> Literal["token-mean", "seq-mean"]:
        """``loss_agg`` with "auto" resolved: seq-mean for the sequence-level losses (gspo)."""
        if self.loss_agg != "auto":
            return self.loss_agg
        return "seq-mean" if self.loss in SEQ_MEAN_LOSSES else "token-mean"
