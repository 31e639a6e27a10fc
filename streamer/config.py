"""Run configuration: TOML decoded into msgspec Structs.

Each section is a Struct with defaults and a one-line comment per field; unknown keys
and bad values are a :class:`ConfigError` naming the key (``$.trainer.lr``). Durations
are seconds. The README's config reference is generated from these classes
(``streamer config-doc``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from schemas.metric_names import DEFAULT_EVAL_SET
from streamer.errors import ConfigError
from streamer.keys import Keys

# the server URL from the environment, between --redis-url and the config file: how `up`
# hands it to its children, so a password never shows in a process's command line
URL_ENV = "STREAMER_REDIS_URL"


# bounds checked where the types are: by the decoder, and by replace() (CLI overrides)
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class RunSection(_Section):
    name: str = "demo"  # run name; every key lives under streamer:{name}:
    redis_url: str = ""  # redis://, rediss://, unix://, redis+cluster://; empty = the embedded server of `up`
    data_dir: str = ".streamer"  # weights, checkpoints, logs and the embedded server's data
    seed: int = 0  # base seed for sampling, shuffling and initialisation

    def __post_init__(self) -> None:
        try:  # the run name is part of every key
            Keys(self.name)
        except ValueError as e:
            raise ValueError(f"`name` is not usable: {e}") from None


class LoraSection(_Section):
    rank: NonNegInt = 0  # LoRA rank r; 0 = train all weights (no adapter)
    alpha: PosFloat = 32.0  # LoRA scale numerator: the update is (alpha / rank) * B A
    target_modules: list[str] = []  # module names to adapt; empty = every linear layer but the head
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = (
        0.0  # dropout on the adapter's input during updates (proximal pass: none)
    )


class ModelSection(_Section):
    name_or_path: str = "demo"  # HF model id or local path; "demo" = the built-in tiny model
    tokenizer: str = ""  # tokenizer id or path; empty = same as name_or_path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    trust_remote_code: bool = False  # allow model code from the hub (off unless asked)
    chat_template: bool = True  # render with the tokenizer's chat template; false = plain prompt
    lora: LoraSection = msgspec.field(default_factory=LoraSection)  # [model.lora]: train an adapter


class BusSection(_Section):
    max_unacked: PosInt = 256  # publishing waits while the trajectory stream holds more unacked
    backpressure_timeout: PosFloat = 600.0  # give up (error) after waiting this long for room
    block_seconds: PosFloat = 2.0  # XREADGROUP/XREAD block time
    socket_timeout: float = 10.0  # must exceed block_seconds (checked)
    claim_idle_seconds: PosFloat = 60.0  # pending entries idle this long are claimed by others
    max_deliveries: PosInt = 5  # entries delivered more often go to the dead-letter stream
    read_count: PosInt = 64  # entries per XREADGROUP
    min_replicas: NonNegInt = 0  # replicas that must hold a write before it is acted on (WAIT)
    replica_timeout: PosFloat = 5.0  # seconds per WAIT; each time it runs out: a warning, then on

    def __post_init__(self) -> None:
        if self.socket_timeout <= self.block_seconds:
            raise ValueError(
                f"`socket_timeout` ({self.socket_timeout}) must exceed "
                f"`block_seconds` ({self.block_seconds}) or blocking reads time out"
            )


class ProducerSection(_Section):
    dataset: str = "demo"  # JSONL file of prompts; "demo" = the built-in task
    group_size: PosInt = 8  # completions per prompt (G)
    min_group_size: PosInt = 2  # fewer good samples than this: the group is not published
    max_new_tokens: PosInt = 16  # completion length cap
    temperature: PosFloat = 1.0  # sampling temperature
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling
    sampler: Literal["local", "remote"] = "local"  # transformers in-process, or an HTTP server
    remote_url: str = ""  # OpenAI-compatible server base URL (remote sampler)
    remote_model: str = ""  # model name sent to the server; empty = model.name_or_path
    remote_timeout: PosFloat = 120.0  # per HTTP request
    remote_retries: NonNegInt = 3  # bounded retries with backoff
    remote_concurrency: PosInt = 8  # in-flight requests per producer
    engine: Literal["vllm", "sglang", "openai"] = (
        "vllm"  # the remote server: how new versions reach it (docs/ENGINES.md)
    )
    reload_endpoint: str = ""  # "" = the engine's reload; else POST {"model_path": dir} here (SGLang's shape)
    lora_endpoint: str = ""  # "" = the engine's LoRA endpoint; else POST {"lora_name", "lora_path"} here
    remote_logprobs: Literal["", "raw", "processed"] = (
        ""  # what the server reports; "" = the engine's default
    )
    reward: str = ""  # "module:function" (row, text, sample) -> float, maybe async; "judge" = [reward.judge]; "" = demo reward / exact_match
    lease_seconds: PosFloat = 60.0  # row lease; renewed while working, expired rows are re-issued
    epochs: NonNegInt = 0  # stop after this many passes over the dataset; 0 = forever
    max_groups: NonNegInt = 0  # stop after publishing this many groups; 0 = forever
    shutdown_grace: PosFloat = 30.0  # on SIGTERM: finish or hand back the current row within this
    torch_threads: NonNegInt = 0  # torch CPU threads of a local sampler; 0 = torch's default
    rollout: str = ""  # "module:function" async (row, ctx) -> episodes, or a rollout service's http(s) URL; "" = single-turn
    concurrency: PosInt = 1  # rollouts (rows) in flight at once, each with its own lease and admission slot
    rollout_timeout: NonNegFloat = 0.0  # cancel a rollout running longer (its row is handed back); 0 = never
    max_reply_bytes: PosInt = (
        67_108_864  # (64 MiB) a rollout service's or engine's answer larger drops the rollout
    )
    max_row_attempts: NonNegInt = (
        3  # skip a row after this many failed rollouts (error, timeout, crash); 0 = never
    )
    defer_after: NonNegInt = (
        3  # set a row aside once its last this many groups were all solved (or all failed)
    )
    revisit_probability: Annotated[float, msgspec.Meta(ge=0, le=1)] = (
        0.1  # chance that a row set aside is handed out anyway when it comes up; 1 = never set rows aside
    )

    def __post_init__(self) -> None:
        if self.min_group_size > self.group_size:
            raise ValueError("`min_group_size` must be <= `group_size`")
        if self.defer_after == 0 and self.revisit_probability < 1:
            raise ValueError(
                "`defer_after` must be >= 1 while `producer.revisit_probability` < 1 (it is "
                f"{self.revisit_probability:g}): 0 would set every row aside before its first group; "
                "set `producer.revisit_probability` = 1 to never set rows aside"
            )
        if self.sampler == "remote" and not self.remote_url:
            raise ValueError('`remote_url` is required when `sampler` is "remote"')
        transformed = self.temperature not in (0.0, 1.0) or self.top_p < 1
        if self.sampler == "remote" and self.logprobs_mode == "raw" and transformed:
            raise ValueError(
                f'`remote_logprobs` is "raw" ({self.engine}\'s default: log-probs before temperature and top-p) '
                f"but temperature = {self.temperature}, top_p = {self.top_p}: the trainer's importance "
                "weights would mix the sampling transform into staleness. Start vLLM with "
                '`--logprobs-mode processed_logprobs` and set remote_logprobs = "processed"'
            )

    @property
    def logprobs_mode(self) -> str:
        """What the remote server's log-probs are: ``remote_logprobs``, or the engine's default
        (vLLM: raw logits' log-softmax; SGLang: the distribution it sampled from)."""
        return self.remote_logprobs or ("processed" if self.engine == "sglang" else "raw")

    @property
    def untied_versions(self) -> bool:
        """Versions are written with ``lm_head`` stored and the config untied: vLLM's reload
        leaves a tied head at its start-up weights."""
        return self.sampler == "remote" and self.engine == "vllm"


class DapoSection(_Section):
    eps_low: NonNegFloat = 0.2  # (dapo) ratio >= 1 - eps_low
    eps_high: NonNegFloat = 0.28  # (dapo) ratio <= 1 + eps_high: clip-higher, wider than eps_low
    eps_clip_c: Annotated[float, msgspec.Meta(gt=1)] = (
        3.0  # (dapo) dual clip: a negative-advantage token's term is bounded at c*A
    )


class GspoSection(_Section):
    eps_low: NonNegFloat = 3e-4  # (gspo) sequence ratio >= 1 - eps_low
    eps_high: NonNegFloat = 4e-4  # (gspo) sequence ratio <= 1 + eps_high


class CispoSection(_Section):
    eps_low: NonNegFloat = 1.0  # (cispo) IS weight >= 1 - eps_low (1 = no lower bound)
    eps_high: NonNegFloat = 4.0  # (cispo) IS weight <= 1 + eps_high


class DroSection(_Section):
    beta: NonNegFloat = 1.0  # (dro) weight of the quadratic penalty (logp - sampler logp)^2 / 2


Precision = Literal["auto", "float32", "bfloat16", "float16"]
LossAgg = Literal["auto", "token-mean", "seq-mean"]

# loss -> the trainer keys it reads (dotted: its own section); the config reference prints it.
# `trainer.loss` may also be "module:function", a loss of one's own (consumers/losses.py)
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


class TrainerSection(_Section):
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


SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # an eval set's name: a bare TOML key, a label value
DEFAULT_SET = DEFAULT_EVAL_SET  # the eval set of the [eval] keys themselves


class EvalSetSection(_Section):
    """One named eval set, ``[eval.sets.NAME]``: its rows, sampling, rollout and reward."""

    dataset: str = ""  # required: held-out JSONL, "demo" or "demo:TASK" (the built-in eval splits)
    k: PosInt = 1  # samples per row, and the k of pass@k
    samples: NonNegInt = 0  # completions per row n >= k for the unbiased pass@k; 0 = k
    temperature: NonNegFloat = 0.0  # sampling temperature; 0 = greedy (one sample per row)
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling
    max_rows: NonNegInt = 0  # evaluate at most this many rows; 0 = all
    max_new_tokens: NonNegInt = 0  # completion length cap; 0 = eval.max_new_tokens
    rollout: str = ""  # "module:function" or a rollout service URL; "" = producer.rollout
    reward: str = ""  # "module:function"; "" = producer.reward, else the dataset's default

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ValueError("`dataset` is required: a JSONL path, or demo / demo:TASK")
        if self.samples and self.samples < self.k:
            raise ValueError(f"`samples` ({self.samples}) must be >= `k` ({self.k}), or 0 for k")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"`temperature` = 0 is greedy: the {self.n} samples of a row would be the same; "
                "set a temperature > 0 or k = 1"
            )

    @property
    def n(self) -> int:
        """Completions sampled per row."""
        return self.samples or self.k


class EvalSection(_Section):
    dataset: str = "demo"  # held-out JSONL; "demo" = the built-in task's eval split; "" = only eval.sets
    eval_every: PosInt = 1  # evaluate every k-th version
    max_rows: NonNegInt = 0  # evaluate at most this many rows; 0 = all
    max_new_tokens: PosInt = 16  # completion length cap (and of the sets that leave theirs 0)
    batch_size: PosInt = 32  # prompts per batched generate of a local model; rows in flight of a rollout
    max_versions: NonNegInt = 0  # stop after evaluating this many versions; 0 = forever (tests: burst)
    remote_url: str = (
        ""  # a server of the evaluator's own (engine: producer.engine); "" = sample like producers
    )
    remote_model: str = ""  # model name sent to eval.remote_url; empty = model.name_or_path
    sets: dict[str, EvalSetSection] = {}  # [eval.sets.NAME]: more named sets, evaluated after "default"

    def __post_init__(self) -> None:
        for name in self.sets:
            if name == DEFAULT_SET or not SET_NAME.fullmatch(name):
                raise ValueError(
                    f"`sets` has a set named {name!r}: use letters, digits, _ and - (at most 64), "
                    f'not {DEFAULT_SET!r} (the set of the [eval] keys; set eval.dataset = "" to drop it)'
                )
        if not self.dataset and not self.sets:
            raise ValueError("`dataset` is empty and there are no `sets`: nothing to evaluate")


class MetricsSection(_Section):
    host: str = "127.0.0.1"  # exporter bind address
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9464  # exporter port (/metrics, /healthz)
    health_interval: PosFloat = 5.0  # seconds between stream-health samples
    stall_seconds: PosFloat = 300.0  # `status` exits 1: no new version this long while groups wait
    snapshot_interval: NonNegFloat = 30.0  # exporter state snapshot, then metrics stream trimmed; 0 = never


class WeightsSection(_Section):
    """How producers and the evaluator check a policy version before loading it."""

    verify: Literal["manifest", "full"] = "manifest"  # manifest = trainer's digests (same fs); full = re-hash


class ArchiveSection(_Section):
    """The rollout archive (`streamer archive`, started by `up`): groups as text on disk."""

    enabled: bool = True  # `up` starts the archiver
    max_bytes: PosInt = 1 << 30  # compressed archive kept under {run_dir}/archive; oldest files go
    file_bytes: PosInt = 16 << 20  # a new file past this many compressed bytes
    max_lag: PosInt = 10_000  # trajectory entries it may fall behind before trimming passes it

    def __post_init__(self) -> None:
        if self.file_bytes > self.max_bytes:
            raise ValueError(
                f"`file_bytes` ({self.file_bytes}) must not exceed `max_bytes` ({self.max_bytes})"
            )


JUDGE_TEMPLATE = (
    "Score the response to the question from 0 to 1.\n\nQuestion: {prompt}\n"
    "Reference answer: {answer}\n\nResponse: {completion}\n\nReply with the score only."
)


class JudgeSection(_Section):
    """The built-in judge reward (``producer.reward = "judge"``): a model asked over HTTP."""

    url: str = ""  # chat: the judge's OpenAI-compatible base URL (…/v1); score: a scoring endpoint's URL
    kind: Literal["chat", "score"] = (
        "chat"  # chat: the number in the reply to `template`; score: {"score": x}
    )
    model: str = ""  # model name sent to a chat judge
    template: str = JUDGE_TEMPLATE  # a chat judge's prompt: {completion}, {prompt} and the row's fields
    api_key_env: str = ""  # environment variable holding the judge's API key (a bearer token); "" = none
    max_tokens: PosInt = 16  # reply length cap of a chat judge
    timeout: PosFloat = 60.0  # seconds per HTTP request to the judge
    retries: NonNegInt = 3  # more tries after an unreachable judge, a 429/5xx or a timeout (backoff)


class RewardSection(_Section):
    """How reward functions are awaited: async ones (the judge too) run concurrently."""

    concurrency: PosInt = 32  # async reward calls in flight at once per producer
    timeout: NonNegFloat = (
        300.0  # seconds per async reward call, retries included (past it: an outage); 0 = none
    )
    judge: JudgeSection = msgspec.field(default_factory=JudgeSection)  # [reward.judge]


class RunConfig(_Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    producer: ProducerSection = msgspec.field(default_factory=ProducerSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    weights: WeightsSection = msgspec.field(default_factory=WeightsSection)
    archive: ArchiveSection = msgspec.field(default_factory=ArchiveSection)
    reward: RewardSection = msgspec.field(default_factory=RewardSection)

    def __post_init__(self) -> None:
        if bad := _non_finite(self):  # inf passes `gt=0`; an lr of inf publishes NaN weights
            key, value = bad
            raise ValueError(f"key `{key}`: must be a finite number, got {value}")
        if self.producer.reward == "judge" and not self.reward.judge.url:
            raise ValueError('key `reward.judge.url`: required when `producer.reward` = "judge"')
        builtin = self.trainer.advantage in ADVANTAGE_NAMES
        if builtin and self.producer.group_size < 2:
            raise ValueError(  # every group would be rejected as zero-variance, silently
                f"key `producer.group_size`: is 1, but advantage {self.trainer.advantage!r} compares a "
                "group's samples and needs at least 2 (or an advantage function that works on one sample)"
            )
        if builtin and self.trainer.min_group_size < 2:
            raise ValueError(
                f"key `trainer.min_group_size`: is {self.trainer.min_group_size}, but advantage "
                f"{self.trainer.advantage!r} needs at least 2 samples per group"
            )
        if self.trainer.fsdp and self.model.lora.rank > 0:
            raise ValueError(
                "key `trainer.fsdp`: LoRA adapters (`model.lora.rank` > 0) are not supported with FSDP yet"
            )

    @property
    def untied_versions(self) -> bool:
        """Versions are written untied when a vLLM server loads them: the producers' or the
        evaluator's own (``eval.remote_url``, served by the same ``producer.engine``)."""
        return self.producer.untied_versions or (
            bool(self.eval.remote_url) and self.producer.engine == "vllm"
        )

    @property
    def run_dir(self) -> Path:
        """Everything this run keeps on disk: {data_dir}/{run name}/."""
        return Path(self.run.data_dir) / self.run.name

    @property
    def weights_dir(self) -> Path:
        return self.run_dir / "weights"  # one directory per policy version

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def require_redis_url(self) -> str:
        if not self.run.redis_url:
            raise ConfigError(
                f"`run.redis_url` is empty: set it, pass --redis-url or ${URL_ENV}, or use `streamer up`"
            )
        return self.run.redis_url


def _non_finite(section: msgspec.Struct, prefix: str = "") -> tuple[str, float] | None:
    """The first float setting (dotted key, value) that is inf or NaN, in any section."""
    for name in section.__struct_fields__:
        value = getattr(section, name)
        if isinstance(value, msgspec.Struct):
            if found := _non_finite(value, f"{prefix}{name}."):
                return found
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{prefix}{name}", value
    return None


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML run config (the built-in demo's is :func:`streamer.demo.config`)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    return parse_config(raw, source=str(path))


def check_across_sections(cfg: RunConfig, source: str = "<config>") -> RunConfig:
    """Limits that involve two sections (a test may still build such a config by hand)."""
    if cfg.bus.max_unacked < cfg.trainer.groups_per_step:
        raise ConfigError(
            f"{source}: `bus.max_unacked` ({cfg.bus.max_unacked}) must be >= `trainer.groups_per_step` "
            f"({cfg.trainer.groups_per_step}): producers stop publishing before one step's groups "
            "are out, so the trainer could never take a step"
        )
    return cfg


def parse_config(raw: bytes | str, *, source: str = "<config>") -> RunConfig:
    try:
        return check_across_sections(msgspec.toml.decode(raw, type=RunConfig), source)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_pretty(_name_set(str(e), raw))}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None


def _name_set(msg: str, raw: bytes | str) -> str:
    """msgspec writes a table key as ``[...]``: put the eval set's name in its place."""
    if "`$.eval.sets[...]" not in msg:
        return msg
    for name, table in msgspec.toml.decode(raw).get("eval", {}).get("sets", {}).items():
        try:
            msgspec.convert(table, EvalSetSection)
        except msgspec.ValidationError as e:
            text, _, where = str(e).partition(" - at `$")
            return f"{text} - at `$.eval.sets.{name}{where or '`'}"
    return msg


def replace(cfg: RunConfig, **sections: dict) -> RunConfig:
    """Copy ``cfg`` with fields of sections replaced: ``replace(cfg, trainer={"steps": 5})``.
    Checked like a config file (ConfigError naming the key)."""
    tree = msgspec.to_builtins(cfg)
    for name, fields in sections.items():
        tree[name].update(msgspec.to_builtins(fields, enc_hook=str))
    try:
        return msgspec.convert(tree, RunConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(_pretty(str(e))) from None


def to_toml(tree: dict, prefix: str = "") -> str:
    """``{section: {key: value}}`` (nested sections allowed, e.g. ``model.lora``) as TOML that
    :func:`parse_config` reads back: strings escaped (a JSON string is a TOML basic string),
    booleans, numbers, non-finite floats, lists. msgspec's TOML encoder would need tomli_w."""

    def value(v) -> str:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, Path):
            v = str(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    flat = {k: v for k, v in tree.items() if not isinstance(v, dict)}
    out = [f"[{prefix}]"] if prefix and flat else []
    out += [f"{k} = {value(v)}" for k, v in flat.items()]
    for k, v in tree.items():
        if isinstance(v, dict):
            out.append(to_toml(v, f"{prefix}.{k}" if prefix else k).rstrip("\n"))
    return "\n".join(out) + "\n"


def write_toml(path: str | Path, tree: dict) -> Path:
    """:func:`to_toml` into ``path``; the path."""
    path = Path(path)
    path.write_text(to_toml(tree))
    return path


def _pretty(msg: str) -> str:
    # msgspec says "<text> - at `$.trainer`"; lead with the full key, which people look for
    text, where = msg, ""
    if " - at `$." in msg:
        text, _, where = msg.rpartition(" - at `$.")
        where = where.rstrip("`")
    if m := re.match(r"Object contains unknown field `([^`]+)`", text):
        return f"unknown key `{_join(where, m.group(1))}`"
    if m := re.match(r"Expected `\w+` ([<>]=? \S+)$", text):  # a bound on the field's type
        return f"key `{where}`: must be {m.group(1)}"
    if m := re.match(r"`(\w+)` (.*)", text):  # raised by a section's __post_init__
        return f"key `{_join(where, m.group(1))}`: {m.group(2)}"
    return f"key `{where}`: {text}" if where else text


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key
