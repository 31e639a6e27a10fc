"""Trainer checkpoints: what was trained, written atomically, read back without pickle.

A checkpoint is a directory ``{root}/step-{step:08d}-v{version:08d}/`` holding

- ``model/``: the weights in HF layout (safetensors + config.json);
- ``optimizer.safetensors``: every optimizer state tensor, keyed ``state.{param}.{name}``;
- ``rng.safetensors``: torch CPU (and CUDA) generator states;
- ``state.json``: :class:`CheckpointMeta` — step, version, the stream high-water id, the
  group and entry ids trained since the parent checkpoint (the audit trail), the
  optimizer's scalar structure, Python's RNG state, the dataset position (the row cursor
  and the rows handed out but not finished: streamer/position.py) and the sha256 of every
  other file.

It is written into a temporary directory, fsynced and renamed into place, so a directory
with a final name is complete; ``state.json`` is written last and names the digest of each
file, so a damaged one is detected and skipped. Version numbers are never reused, which
makes the names unique. Pruned checkpoints keep their ``state.json`` so the audit chain
(parent links back to the first checkpoint) stays readable forever.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file, save_file

from streamer import weights
from streamer.disk import atomic_dir, numbered, remove_unfinished
from streamer.errors import CheckpointError
from streamer.position import DataPosition
from streamer.weights import sha256_file

log = logging.getLogger(__name__)

FORMAT = 1
STATE = "state.json"
_NAME = re.compile(r"^step-(\d{8,})-v(\d{8,})$")


@dataclass(frozen=True)
class Covered:
    """What a checkpoint taken now covers: the entries trained since the last one."""

    high_water: str  # the newest entry id trained into the model
    entry_ids: list[str]
    group_ids: list[str]


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the directory name
    step: int  # trainer steps taken (each ppo_minibatches optimizer steps)
    version: int  # policy version of these weights
    parent: str | None  # the checkpoint this one continues (None: the initial model)
    high_water: str  # newest trajectory stream id trained into these weights ("0-0": none)
    group_ids: list[str]  # groups trained since the parent, in training order
    entry_ids: list[str]  # their stream entry ids
    files: dict[str, str]  # relative path -> sha256 of every other file
    optimizer: dict[str, Any]  # param_groups and non-tensor state of the optimizer
    python_rng: list[Any]  # random.getstate()
    created_at: float
    data: DataPosition | None = None  # the dataset position when it was written (None: not read)
    format: int = FORMAT


def name_for(step: int, version: int) -> str:
    return f"step-{step:08d}-v{version:08d}"


def save(
    root: Path,
    *,
    model,
    optimizer_state: dict,
    step: int,
    version: int,
    parent: str | None,
    covered: Covered,
    data: DataPosition | None = None,
) -> CheckpointMeta:
    """Write a checkpoint atomically; returns its metadata once it is durable on disk."""
    root = Path(root)
    name = name_for(step, version)
    with atomic_dir(root, name, what=f"checkpoint {name}") as tmp:  # disk full: one clear DiskError
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tensors, layout = _flatten_optimizer(optimizer_state)
        save_file(tensors, tmp / "optimizer.safetensors")
        save_file(_rng_tensors(), tmp / "rng.safetensors")
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = CheckpointMeta(
            name=name,
            step=step,
            version=version,
            parent=parent,
            high_water=covered.high_water,
            group_ids=list(covered.group_ids),
            entry_ids=list(covered.entry_ids),
            files=files,
            optimizer=layout,
            python_rng=_jsonable(random.getstate()),
            created_at=time.time(),
            data=data,
        )
        (tmp / STATE).write_bytes(msgspec.json.encode(meta))
    return meta


def read_meta(path: Path) -> CheckpointMeta:
    """The metadata of a checkpoint directory (not checking its files)."""
    try:
        meta = msgspec.json.decode((Path(path) / STATE).read_bytes(), type=CheckpointMeta)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(f"{path}: unreadable {STATE}: {e}") from None
    if meta.format != FORMAT or meta.name != Path(path).name:
        raise CheckpointError(f"{path}: format {meta.format} / name {meta.name!r} do not match")
    return meta


def verify(path: Path) -> CheckpointMeta:
    """Metadata of a complete, undamaged checkpoint; CheckpointError otherwise."""
    meta = read_meta(path)
    for rel, sha in meta.files.items():
        f = Path(path) / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        if sha256_file(f) != sha:
            raise CheckpointError(f"{path}: {rel} does not match its sha256")
    return meta


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest (highest version) first."""
    return [p for _, p in reversed(numbered(root, _NAME))]


def latest(root: Path) -> tuple[Path, CheckpointMeta] | None:
    """The newest valid checkpoint; damaged or partial ones are skipped with a log line."""
    for path in candidates(root):
        try:
            return path, verify(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path.name, e)
    return None


def restore(path: Path, meta: CheckpointMeta, *, model, optimizer: torch.optim.Optimizer) -> None:
    """Load weights, optimizer state and RNG state of a verified checkpoint in place."""
    path = Path(path)
    weights.load_into(model, path / "model")
    optimizer.load_state_dict(_optimizer_state(path, meta))
    _restore_rng(path, meta)


def read(path: Path, meta: CheckpointMeta, *, model) -> tuple[dict[str, torch.Tensor], dict]:
    """A sharded trainer's restore: the full weights (checked against ``model``) and optimizer
    state as one process saved them, for each rank to take its shards of; RNG restored."""
    path = Path(path)
    full = weights.read_full(model, path / "model")
    state = _optimizer_state(path, meta)
    _restore_rng(path, meta)
    return full, state


def _optimizer_state(path: Path, meta: CheckpointMeta) -> dict:
    # copies, not views into the file's mmap: the optimizer keeps them, and a mapped file's
    # disk space is not freed when the checkpoint is pruned (nor can its disk go read-only)
    tensors = {k: t.clone() for k, t in load_file(path / "optimizer.safetensors").items()}
    return _unflatten_optimizer(tensors, meta.optimizer)


def _restore_rng(path: Path, meta: CheckpointMeta) -> None:
    rng = load_file(path / "rng.safetensors")
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    random.setstate(_tuples(meta.python_rng))


def prune(root: Path, keep: int) -> list[str]:
    """Reduce all but the newest ``keep`` checkpoints to their state.json; drop temp dirs."""
    remove_unfinished(root)
    pruned = []
    for path in candidates(root)[keep:]:
        extra = [p for p in path.iterdir() if p.name != STATE]
        for p in extra:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if extra:
            pruned.append(path.name)
    return pruned


def audit_chain(root: Path) -> list[CheckpointMeta]:
    """The checkpoints the persisted model is made of, oldest first (empty if none).

    Starts at the newest valid checkpoint and follows ``parent`` links through pruned
    ones. The concatenated ``group_ids`` are every group trained into the model.
    """
    found = latest(root)
    if found is None:
        return []
    chain = [found[1]]
    while chain[-1].parent is not None:
        chain.append(read_meta(Path(root) / chain[-1].parent))
    return chain[::-1]


# ---------------------------------------------------------------- helpers


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    groups = [_jsonable(g) for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], layout: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, values in layout.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in layout["param_groups"]]
    return {"state": state, "param_groups": groups}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i:03d}"] = s
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v
