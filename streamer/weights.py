"""Policy weights on disk: safetensors in HF layout, one directory per version.

The trainer writes ``{root}/v{version:08d}/`` (model.safetensors + config.json) into a
temporary directory and renames it into place, so a reader never sees half a version.
Readers accept only ``file://`` URIs inside the configured root whose sha256 matches.
No pickle: nothing here calls ``torch.load``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import urllib.parse
from pathlib import Path

from schemas import WeightSync
from streamer.errors import DiskError, WeightsError

log = logging.getLogger(__name__)

_PREFIX = "v"


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"{_PREFIX}{version:08d}"


def digest(directory: Path) -> str:
    """sha256 over the directory's *.safetensors files, in name order."""
    h = hashlib.sha256()
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no .safetensors files in {directory}")
    for f in files:
        _hash_into(h, f)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    return _hash_into(hashlib.sha256(), path).hexdigest()


def _hash_into(h, path: Path):
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h


def write_version(model, root: Path, version: int) -> tuple[str, str]:
    """Save ``model`` (a transformers PreTrainedModel) as version ``version``; (uri, sha256)."""
    root = Path(root).resolve()
    final = version_dir(root, version)
    with writing(f"policy version {version}", root):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            sha = digest(tmp)
            for f in tmp.iterdir():
                fsync(f)
            if final.exists():  # a version number is never reused; a leftover is from a crash
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final.as_uri(), sha


@contextlib.contextmanager
def writing(what: str, directory: Path):
    """Turn a failed write (disk full, read-only, no permission) into one clear DiskError."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise DiskError(f"cannot write {what} in {directory}: {reason}") from e


def versions(root: Path) -> list[int]:
    """Version numbers with a weights directory under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[len(_PREFIX) :])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
    )


def prune(root: Path, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
    """Delete all but the newest ``keep`` versions (and stale temp dirs); returns deleted."""
    root = Path(root)
    if not root.exists():
        return []
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    versions = sorted(
        int(p.name[len(_PREFIX) :])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
    )
    doomed = [v for v in versions[:-keep] if v not in protect] if keep > 0 else []
    for v in doomed:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    return doomed


def resolve(sync: WeightSync, root: Path, *, check_sha: bool = True) -> Path:
    """The local directory of ``sync``'s weights, refusing anything outside ``root``."""
    parts = urllib.parse.urlsplit(sync.uri)
    if parts.scheme != "file":
        raise WeightsError(f"version {sync.version}: unsupported weights uri {sync.uri!r}")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    root = Path(root).resolve()
    if not path.is_relative_to(root):
        raise WeightsError(f"version {sync.version}: weights {path} are outside {root}")
    if not path.is_dir():
        raise WeightsError(f"version {sync.version}: weights directory {path} does not exist")
    if check_sha and (actual := digest(path)) != sync.sha256:
        raise WeightsError(
            f"version {sync.version}: sha256 mismatch ({actual[:12]}... != {sync.sha256[:12]}...)"
        )
    return path


def load_into(model, directory: Path) -> None:
    """Load a version directory's safetensors into ``model`` in place (strict, tied-aware)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(f, device=str(next(model.parameters()).device)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_keys(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise WeightsError(
            f"weights in {directory} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if tied:
        model.tie_weights()


def _tied_keys(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(keys, dict):  # transformers 5: {target: source}
        keys = keys.keys()
    return set(keys) if getattr(model.config, "tie_word_embeddings", False) else set()


def fsync(path: Path) -> None:
    """fsync a file or directory, best effort (some filesystems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
