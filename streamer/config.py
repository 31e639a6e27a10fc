"""Run configuration: TOML decoded into msgspec Structs.

Each section is a Struct with defaults and a one-line comment per field; unknown keys
and bad values are a :class:`ConfigError` naming the key (``$.trainer.lr``). Durations
are seconds. The README's config reference is generated from these classes
(``streamer config-doc``). This module holds the run-wide sections, :class:`RunConfig`
and how a config is read, checked and overridden; the trainer's section is in
``config_trainer``, the producers', evaluator's and rewards' in ``config_rollout``, the
training rows' sources in ``config_dataset``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from streamer.config_base import NonNegFloat, NonNegInt, PosFloat, PosInt, Section
from streamer.config_dataset import DatasetSection
from streamer.config_rollout import EvalSection, EvalSetSection, ProducerSection, RewardSection
from streamer.config_trainer import ADVANTAGE_NAMES, TrainerSection
from streamer.errors import ConfigError
from streamer.keys import Keys

# the server URL from the environment, between --redis-url and the config file: how `up`
# hands it to its children, so a password never shows in a process's command line
URL_ENV = "STREAMER_REDIS_URL"


class RunSection(Section):
    name: str = "demo"  # run name; every key lives under streamer:{name}:
    redis_url: str = ""  # redis://, rediss://, unix://, redis+cluster://; empty = the embedded server of `up`
    data_dir: str = ".streamer"  # weights, checkpoints, logs and the embedded server's data
    seed: int = 0  # base seed for sampling, shuffling and initialisation

    def __post_init__(self) -> None:
        try:  # the run name is part of every key
            Keys(self.name)
        except ValueError as e:
            raise ValueError(f"`name` is not usable: {e}") from None


class LoraSection(Section):
    rank: NonNegInt = 0  # LoRA rank r; 0 = train all weights (no adapter)
    alpha: PosFloat = 32.0  # LoRA scale numerator: the update is (alpha / rank) * B A
    target_modules: list[str] = []  # module names to adapt; empty = every linear layer but the head
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = (
        0.0  # dropout on the adapter's input during updates (proximal pass: none)
    )


class ModelSection(Section):
    name_or_path: str = "demo"  # HF model id or local path; "demo" = the built-in tiny model
    tokenizer: str = ""  # tokenizer id or path; empty = same as name_or_path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    trust_remote_code: bool = False  # allow model code from the hub (off unless asked)
    chat_template: bool = True  # render with the tokenizer's chat template; false = plain prompt
    lora: LoraSection = msgspec.field(default_factory=LoraSection)  # [model.lora]: train an adapter


class BusSection(Section):
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


class MetricsSection(Section):
    host: str = "127.0.0.1"  # exporter bind address
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9464  # exporter port (/metrics, /healthz)
    health_interval: PosFloat = 5.0  # seconds between stream-health samples
    stall_seconds: PosFloat = 300.0  # `status` exits 1: no new version this long while groups wait
    snapshot_interval: NonNegFloat = 30.0  # exporter state snapshot, then metrics stream trimmed; 0 = never


class WeightsSection(Section):
    """How producers and the evaluator check a policy version before loading it."""

    verify: Literal["manifest", "full"] = "manifest"  # manifest = re-hash changed files; full = all


class ArchiveSection(Section):
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


_WANDB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")


class TrackingSection(Section):
    """Experiment tracking (`streamer track`, started by `up` when a backend is set)."""

    backend: Literal["", "tensorboard", "wandb"] = ""  # where the run's metrics go; "" = no tracking
    dir: str = ""  # the tracker's files; empty = {run_dir}/tracking
    project: str = "streamer"  # W&B project
    entity: str = ""  # W&B team or user; empty = the account's default
    name: str = ""  # W&B run display name; empty = the run name
    id: str = ""  # W&B run id (a restart resumes it); empty = one made on the first start, kept in dir
    mode: Literal["", "online", "offline"] = ""  # W&B mode; empty = wandb's own (WANDB_MODE, `wandb offline`)
    samples_every: NonNegInt = 10  # a table of sampled completions every N policy versions; 0 = none
    samples_per_table: PosInt = 16  # completions in each table (read from the rollout archive)
    max_lag: PosInt = 100_000  # metrics entries it may fall behind before the exporter's trim passes it

    def __post_init__(self) -> None:
        if self.id and not _WANDB_ID.match(self.id):
            raise ValueError(f"`id` {self.id!r}: use 1-64 letters, digits, '_', '.' or '-'")


class RunConfig(Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    producer: ProducerSection = msgspec.field(default_factory=ProducerSection)
    dataset: DatasetSection = msgspec.field(default_factory=DatasetSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)
    weights: WeightsSection = msgspec.field(default_factory=WeightsSection)
    archive: ArchiveSection = msgspec.field(default_factory=ArchiveSection)
    tracking: TrackingSection = msgspec.field(default_factory=TrackingSection)
    reward: RewardSection = msgspec.field(default_factory=RewardSection)

    def __post_init__(self) -> None:
        if bad := _non_finite(self):  # inf passes `gt=0`; an lr of inf publishes NaN weights
            key, value = bad
            raise ValueError(f"key `{key}`: must be a finite number, got {value}")
        if self.dataset.sources and self.producer.dataset != ProducerSection().dataset:
            raise ValueError(
                f"key `producer.dataset`: is {self.producer.dataset!r}, but [[dataset.sources]] name the "
                "training rows: list it as a source instead (or drop the sources)"
            )
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
    def dataset_cache_dir(self) -> Path:
        """Where datasets keeps the Arrow conversions: ``dataset.cache_dir``, else {data_dir}/datasets
        (shared by the runs of a data dir: a file converted once serves them all)."""
        return Path(self.dataset.cache_dir or Path(self.run.data_dir) / "datasets")

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def tracking_dir(self) -> Path:
        return Path(self.tracking.dir) if self.tracking.dir else self.run_dir / "tracking"

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
    """``{section: {key: value}}`` (nested sections allowed, e.g. ``model.lora``; a list of
    tables is an array of tables, ``[[dataset.sources]]``) as TOML that :func:`parse_config`
    reads back: strings escaped (a JSON string is a TOML basic string), booleans, numbers,
    non-finite floats, lists. msgspec's TOML encoder would need tomli_w."""

    def value(v) -> str:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, Path):
            v = str(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    def tables(v) -> bool:
        return isinstance(v, list | tuple) and bool(v) and all(isinstance(x, dict) for x in v)

    flat = {k: v for k, v in tree.items() if not isinstance(v, dict) and not tables(v)}
    out = [f"[{prefix}]"] if prefix and flat else []
    out += [f"{k} = {value(v)}" for k, v in flat.items()]
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.append(to_toml(v, name).rstrip("\n"))
        elif tables(v):  # nested tables inside an array's tables are not needed yet
            out += [f"[[{name}]]\n" + to_toml(x).rstrip("\n") for x in v]
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
