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
from typing import Literal

import msgspec

from streamer.errors import ConfigError
from streamer.keys import Keys

# the server URL from the environment, between --redis-url and the config file: how `up`
# hands it to its children, so a password never shows in a process's command line
URL_ENV = "STREAMER_REDIS_URL"


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    def _positive(self, *names: str, allow_zero: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if value < 0 or (value == 0 and not allow_zero):
                bound = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"`{name}` must be {bound}, got {value}")


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
    rank: int = 0  # LoRA rank r; 0 = train all weights (no adapter)
    alpha: float = 32.0  # LoRA scale numerator: the update is (alpha / rank) * B A
    target_modules: list[str] = []  # module names to adapt; empty = every linear layer but the head
    dropout: float = 0.0  # dropout on the adapter's input during updates (proximal pass: none)

    def __post_init__(self) -> None:
        self._positive("rank", "dropout", allow_zero=True)
        self._positive("alpha")
        if self.dropout >= 1:
            raise ValueError(f"`dropout` must be < 1, got {self.dropout}")


class ModelSection(_Section):
    name_or_path: str = "demo"  # HF model id or local path; "demo" = the built-in tiny model
    tokenizer: str = ""  # tokenizer id or path; empty = same as name_or_path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    trust_remote_code: bool = False  # allow model code from the hub (off unless asked)
    chat_template: bool = True  # render with the tokenizer's chat template; false = plain prompt
    lora: LoraSection = msgspec.field(default_factory=LoraSection)  # [model.lora]: train an adapter


class BusSection(_Section):
    max_unacked: int = 256  # publishing waits while the trajectory stream holds more unacked
    backpressure_timeout: float = 600.0  # give up (error) after waiting this long for room
    block_seconds: float = 2.0  # XREADGROUP/XREAD block time
    socket_timeout: float = 10.0  # must exceed block_seconds (checked)
    claim_idle_seconds: float = 60.0  # pending entries idle this long are claimed by others
    max_deliveries: int = 5  # entries delivered more often go to the dead-letter stream
    read_count: int = 64  # entries per XREADGROUP

    def __post_init__(self) -> None:
        self._positive("max_unacked", "backpressure_timeout", "block_seconds", "read_count")
        self._positive("claim_idle_seconds", "max_deliveries")
        if self.socket_timeout <= self.block_seconds:
            raise ValueError(
                f"`socket_timeout` ({self.socket_timeout}) must exceed "
                f"`block_seconds` ({self.block_seconds}) or blocking reads time out"
            )


class ProducerSection(_Section):
    dataset: str = "demo"  # JSONL file of prompts; "demo" = the built-in task
    group_size: int = 8  # completions per prompt (G)
    min_group_size: int = 2  # fewer good samples than this: the group is not published
    max_new_tokens: int = 16  # completion length cap
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling
    sampler: Literal["local", "remote"] = "local"  # transformers in-process, or an HTTP server
    remote_url: str = ""  # OpenAI-compatible server base URL (remote sampler)
    remote_model: str = ""  # model name sent to the server; empty = model.name_or_path
    remote_timeout: float = 120.0  # per HTTP request
    remote_retries: int = 3  # bounded retries with backoff
    remote_concurrency: int = 8  # in-flight requests per producer
    reload_endpoint: str = "/update_weights_from_disk"  # POSTed on new weights (SGLang)
    lora_endpoint: str = "/v1/load_lora_adapter"  # POSTed on a new LoRA adapter version (vLLM, SGLang)
    remote_logprobs: Literal["raw", "processed"] = "raw"  # what the server reports: see below
    reward: str = ""  # "module:function" (row, text, sample) -> float; "" = demo reward / exact_match
    lease_seconds: float = 60.0  # row lease; renewed while working, expired rows are re-issued
    epochs: int = 0  # stop after this many passes over the dataset; 0 = forever
    max_groups: int = 0  # stop after publishing this many groups; 0 = forever
    shutdown_grace: float = 30.0  # on SIGTERM: finish or hand back the current row within this
    torch_threads: int = 0  # torch CPU threads of a local sampler; 0 = torch's default
    rollout: str = ""  # "module:function" async (row, ctx) -> episodes; "" = single-turn render/sample/reward
    concurrency: int = 1  # rollouts (rows) in flight at once, each with its own lease and admission slot
    rollout_timeout: float = 0.0  # cancel a rollout running longer (its row is handed back); 0 = never
    max_row_attempts: int = 3  # skip a row after this many failed rollouts (error, timeout, crash); 0 = never

    def __post_init__(self) -> None:
        self._positive("group_size", "min_group_size", "max_new_tokens", "lease_seconds")
        self._positive("temperature", "top_p", "remote_timeout", "remote_concurrency")
        self._positive("remote_retries", "epochs", "max_groups", allow_zero=True)
        self._positive("shutdown_grace")
        self._positive("torch_threads", "rollout_timeout", "max_row_attempts", allow_zero=True)
        self._positive("concurrency")
        if self.top_p > 1:
            raise ValueError(f"`top_p` must be <= 1, got {self.top_p}")
        if self.min_group_size > self.group_size:
            raise ValueError("`min_group_size` must be <= `group_size`")
        if self.sampler == "remote" and not self.remote_url:
            raise ValueError('`remote_url` is required when `sampler` is "remote"')
        transformed = self.temperature not in (0.0, 1.0) or self.top_p < 1
        if self.sampler == "remote" and self.remote_logprobs == "raw" and transformed:
            raise ValueError(
                '`remote_logprobs` is "raw" (vLLM\'s default: log-probs before temperature and top-p) '
                f"but temperature = {self.temperature}, top_p = {self.top_p}: the trainer's importance "
                "weights would mix the sampling transform into staleness. Start vLLM with "
                '`--logprobs-mode processed_logprobs` and set remote_logprobs = "processed"'
            )


class _ClipSection(_Section):
    def __post_init__(self) -> None:
        self._positive("eps_low", "eps_high", allow_zero=True)


class DapoSection(_ClipSection):
    eps_low: float = 0.2  # (dapo) ratio >= 1 - eps_low
    eps_high: float = 0.28  # (dapo) ratio <= 1 + eps_high: clip-higher, wider than eps_low
    eps_clip_c: float = 3.0  # (dapo) dual clip: a negative-advantage token's term is bounded at c*A

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps_clip_c <= 1:
            raise ValueError(f"`eps_clip_c` must be > 1, got {self.eps_clip_c}")


class GspoSection(_ClipSection):
    eps_low: float = 3e-4  # (gspo) sequence ratio >= 1 - eps_low
    eps_high: float = 4e-4  # (gspo) sequence ratio <= 1 + eps_high


class CispoSection(_ClipSection):
    eps_low: float = 1.0  # (cispo) IS weight >= 1 - eps_low (1 = no lower bound)
    eps_high: float = 4.0  # (cispo) IS weight <= 1 + eps_high


Precision = Literal["auto", "float32", "bfloat16", "float16"]
LossName = Literal["grpo", "dapo", "gspo", "cispo", "reinforce", "importance_sampling"]

# loss -> the trainer keys it reads (dotted: its own section); the config reference prints it
LOSS_KEYS = {
    "grpo": ("tis_cap", "eps_low", "eps_high"),
    "dapo": ("tis_cap", "dapo.eps_low", "dapo.eps_high", "dapo.eps_clip_c"),
    "gspo": ("tis_cap", "gspo.eps_low", "gspo.eps_high"),
    "cispo": ("tis_cap", "cispo.eps_low", "cispo.eps_high"),
    "reinforce": ("tis_cap",),
    "importance_sampling": (),
}
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo")


class TrainerSection(_Section):
    groups_per_step: int = 8  # accepted groups per trainer step
    max_staleness: int = 1  # versions a group may lag the policy; 0 = synchronous on-policy
    steps: int = 0  # stop after this many steps; 0 = forever
    lr: float = 1e-5  # AdamW learning rate
    warmup_steps: int = 0  # linear LR warmup, in optimizer steps
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup (consumers/schedule.py)
    lr_decay_steps: int = 0  # optimizer steps from 0 to the end of decay; 0 = steps * ppo_minibatches
    min_lr_ratio: float = 0.0  # the decayed LR's floor, as a fraction of lr
    weight_decay: float = 0.01  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm
    ppo_minibatches: int = 1  # optimizer steps per trainer step (the batch split in row slices)
    eps_low: float = 0.2  # PPO clip: ratio >= 1 - eps_low
    eps_high: float = 0.2  # PPO clip: ratio <= 1 + eps_high
    tis_cap: float = 5.0  # truncated importance weight cap against sampler log-probs
    kl_coef: float = 0.0  # k3 KL to the frozen initial model; 0 = no reference model
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"  # loss aggregation
    std_normalize: bool = True  # divide advantages by the group std (floored)
    std_floor: float = 1e-4  # floor of the group std
    overlong: Literal["drop", "mask", "keep"] = "drop"  # samples truncated without EOS
    user_filter: str = ""  # import path of (group) -> bool; false rejects the group
    checkpoint_every: int = 10  # steps between checkpoints (and at exit)
    keep_versions: int = 3  # weight versions kept on disk
    gradient_checkpointing: bool = False  # trade compute for memory
    min_group_size: int = 2  # fewer samples (after dropping over-long ones) rejects the group
    micro_batch_size: int = 0  # samples per forward/backward (grad accumulation); 0 = whole minibatch
    keep_checkpoints: int = 2  # full checkpoints kept; older ones keep only their audit metadata
    loss: LossName = "grpo"  # grpo, dapo, gspo, cispo, reinforce, importance_sampling (table below)
    advantage: str = "grpo"  # grpo (z-score), dr_grpo (no std), rloo (leave one out) or module:function
    max_seq_len: int = (
        0  # samples (prompt + completion) longer: dropped by producers, rejected here (too_long); 0 = off
    )
    precision: Precision = "auto"  # autocast dtype; auto = model.dtype if half; weights stay float32
    dapo: DapoSection = msgspec.field(default_factory=DapoSection)  # read when loss = "dapo"
    gspo: GspoSection = msgspec.field(default_factory=GspoSection)  # read when loss = "gspo"
    cispo: CispoSection = msgspec.field(default_factory=CispoSection)  # read when loss = "cispo"

    def __post_init__(self) -> None:
        self._positive("groups_per_step", "lr", "grad_clip", "ppo_minibatches", "tis_cap")
        self._positive("checkpoint_every", "keep_versions", "std_floor")
        self._positive("min_group_size", "keep_checkpoints")
        self._positive("micro_batch_size", "max_seq_len", "lr_decay_steps", "min_lr_ratio", allow_zero=True)
        if self.min_lr_ratio > 1:
            raise ValueError(f"`min_lr_ratio` must be <= 1, got {self.min_lr_ratio}")
        if self.lr_schedule != "constant" and not (self.lr_decay_steps or self.steps):
            raise ValueError(
                f"`lr_schedule` = {self.lr_schedule!r} needs a length: set `lr_decay_steps` or `steps`"
            )
        self._positive("max_staleness", "steps", "warmup_steps", "kl_coef", allow_zero=True)
        self._positive("eps_low", "eps_high", "weight_decay", allow_zero=True)
        if ":" not in self.advantage and "." not in self.advantage and self.advantage not in ADVANTAGE_NAMES:
            raise ValueError(
                f"`advantage` must be one of {', '.join(ADVANTAGE_NAMES)} or 'module:function', "
                f"got {self.advantage!r}"
            )


class EvalSection(_Section):
    dataset: str = "demo"  # held-out JSONL; "demo" = the built-in task's eval split
    eval_every: int = 1  # evaluate every k-th version
    max_rows: int = 0  # evaluate at most this many rows; 0 = all
    max_new_tokens: int = 16  # completion length cap (greedy decoding)
    batch_size: int = 32  # prompts per batched greedy generate
    max_versions: int = 0  # stop after evaluating this many versions; 0 = forever (tests: burst)

    def __post_init__(self) -> None:
        self._positive("eval_every", "max_new_tokens", "batch_size")
        self._positive("max_rows", "max_versions", allow_zero=True)


class MetricsSection(_Section):
    host: str = "127.0.0.1"  # exporter bind address
    port: int = 9464  # exporter port (/metrics, /healthz)
    health_interval: float = 5.0  # seconds between stream-health samples
    stall_seconds: float = 300.0  # `status` exits 1: no new version this long while groups wait
    snapshot_interval: float = 30.0  # exporter state snapshot, then metrics stream trimmed; 0 = never

    def __post_init__(self) -> None:
        self._positive("health_interval", "stall_seconds")
        self._positive("snapshot_interval", allow_zero=True)
        if not 0 <= self.port < 65536:
            raise ValueError(f"`port` must be in 0..65535, got {self.port}")


class WeightsSection(_Section):
    """How producers and the evaluator check a policy version before loading it."""

    verify: Literal["manifest", "full"] = "manifest"  # manifest = trainer's digests (same fs); full = re-hash


class ArchiveSection(_Section):
    """The rollout archive (`streamer archive`, started by `up`): groups as text on disk."""

    enabled: bool = True  # `up` starts the archiver
    max_bytes: int = 1 << 30  # compressed archive kept under {run_dir}/archive; oldest files go
    file_bytes: int = 16 << 20  # a new file past this many compressed bytes
    max_lag: int = 10_000  # trajectory entries it may fall behind before trimming passes it

    def __post_init__(self) -> None:
        self._positive("max_bytes", "file_bytes", "max_lag")
        if self.file_bytes > self.max_bytes:
            raise ValueError(
                f"`file_bytes` ({self.file_bytes}) must not exceed `max_bytes` ({self.max_bytes})"
            )


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

    def __post_init__(self) -> None:
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


def load_config(path: str | Path | None) -> RunConfig:
    """Read a TOML run config; None gives the built-in demo's config."""
    if path is None:
        from streamer import demo

        return demo.config()
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
        raise ConfigError(f"{source}: {_pretty(str(e))}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None


def replace(cfg: RunConfig, **sections: dict) -> RunConfig:
    """Copy ``cfg`` with fields of sections replaced: ``replace(cfg, trainer={"steps": 5})``."""
    changes = {
        name: msgspec.structs.replace(getattr(cfg, name), **fields) for name, fields in sections.items()
    }
    return msgspec.structs.replace(cfg, **changes)


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
    if m := re.match(r"`(\w+)` (.*)", text):  # raised by a section's __post_init__
        return f"key `{_join(where, m.group(1))}`: {m.group(2)}"
    return f"key `{where}`: {text}" if where else text


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key
