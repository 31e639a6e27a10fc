"""Policy weights on disk: safetensors in HF layout, one directory per version.

The trainer writes ``{root}/v{version:08d}/`` (model.safetensors + config.json and a
manifest.json) into a temporary directory and renames it into place, so a reader never
sees half a version. The manifest lists every file's size and the BLAKE3 of each of its
16 MiB pieces (streamer/pieces.py: hashed while written, on several cores), and the
version's announcement (:class:`schemas.WeightSync`) carries the sha256 of the manifest:
one hash of every byte in a row would take a core longer than writing them.

Readers accept only ``file://`` URIs inside the configured root whose manifest hashes to
the announced sha256, with every file there at its listed size. The manifest also records
each file as the writer left it (inode, modification and change times, and the kernel's
boot id): a reader in the same boot that finds every file so is reading the very bytes that
were hashed (and checked for inf and NaN) as they were written, and trusts them; any other
reader re-hashes every piece before loading — another machine, a machine that has rebooted
since (a version is not fsynced: checkpoints are the durable state, and after a crash the
trainer publishes its checkpoint again under a new number), or a file written to since.
``verify="full"`` always re-hashes. No pickle: nothing here calls ``torch.load``.

A version directory is never changed once it is in place (a newer version is a new
directory; pruning deletes whole directories): a sampler on the CPU maps the files it loads
rather than copying them (streamer/tensorfile.py), so rewriting or truncating a loaded file
in place would change or crash it (SIGBUS), where deleting it changes nothing (its space is
freed when the sampler loads another version).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import socket
import urllib.parse
from pathlib import Path

from schemas import WeightSync
from streamer import pieces, tensorfile
from streamer.disk import atomic_dir, fsync, numbered, remove_unfinished, writing  # noqa: F401 (importable from here too)
from streamer.errors import WeightsError
from streamer.tensorfile import NonFinite

_PREFIX = "v"
_NAME = re.compile(rf"^{_PREFIX}(\d+)$")  # a version directory's name
WEIGHTS_FILE = "model.safetensors"
MANIFEST = "manifest.json"  # every file's size and pieces' hashes; announced by its own sha256
MANIFEST_FORMAT = 3  # 2: the pieces' sha256; 1: per-file sha256
VERIFY_MODES = ("manifest", "full")


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"{_PREFIX}{version:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class WeightsCopy:
    """A CPU copy of a model's weights that saves like the model (tied tensors stay tied).

    ``state``: weights already copied (a sharded trainer's, gathered onto rank 0), kept as
    they are."""

    def __init__(self, model, state: dict | None = None):
        self.model = model
        if state is not None:
            self.state = state
            return
        copies: dict = {}
        self.state = {}
        for name, t in model.state_dict().items():
            key = t.data_ptr()
            if key not in copies:
                copies[key] = t.detach().to("cpu", copy=True)
            self.state[name] = copies[key]

    def state_dict(self) -> dict:
        return self.state

    def save_pretrained(self, path, **kwargs) -> None:
        self.model.save_pretrained(path, state_dict=self.state, **kwargs)


def write_version(model, root: Path, version: int, *, dtype=None, untie: bool = False) -> tuple[str, str]:
    """Save ``model`` (a transformers PreTrainedModel, or a :class:`WeightsCopy` of one) as
    version ``version``; (uri, sha256 of its manifest). ``dtype``: floating tensors are
    written in it (the samplers' ``model.dtype``); ``untie``: see :func:`save`.

    The bytes are hashed as they are written and every file's pieces go into
    ``manifest.json``; the directory appears under its final name only once complete.
    Weights holding inf or NaN are never written: :class:`NonFinite` (naming the tensor),
    checked as the bytes are written (after any cast to ``dtype``), and nothing appears.
    """
    root = Path(root).resolve()
    final = version_dir(root, version)
    with atomic_dir(root, final.name, what=f"policy version {version}", durable=False) as tmp:
        sha = _write_manifest(tmp, version, save(model, tmp, dtype=dtype, untie=untie))
    return final.as_uri(), sha


_JSON: dict[tuple, tuple[dict, str]] = {}  # (type, id, how written) -> (its attributes then, text)
_JSON_KEPT = 8


def _json_text(obj, key: tuple, make) -> str:
    """``make()``, the JSON transformers writes for ``obj`` (a model's or a generation
    config), computed again only once one of ``obj``'s attributes has changed: transformers
    diffs it against a fresh default config every time (~1 ms), and a run writes the same
    config with every version."""
    k = (type(obj), id(obj), *key)
    hit = _JSON.get(k)
    if hit is not None and hit[0] == obj.__dict__:
        return hit[1]
    text = make()
    try:
        state = copy.deepcopy(obj.__dict__)
    except Exception:  # an attribute that cannot be copied: not remembered
        return text
    if len(_JSON) >= _JSON_KEPT:
        _JSON.clear()
    _JSON[k] = (state, text)
    return text


def save(model, directory: Path, *, dtype=None, untie: bool = False) -> dict[str, dict]:
    """model.safetensors (HF layout, tied tensors once) + config files; {file: {bytes, pieces}}.
    :class:`NonFinite` if a floating tensor holds inf or NaN (the directory is then incomplete).

    ``dtype``: floating tensors are cast to it. ``untie``: a model with tied input and output
    embeddings is written untied (``lm_head.weight`` stored, ``tie_word_embeddings`` false),
    for an engine that reloads the head only from its own tensor (vLLM). A LoRA policy
    (streamer.lora.AdapterView) is saved in PEFT layout instead: its adapter's megabytes are
    hashed after writing, not while.
    """
    from streamer import lora

    state = getattr(model, "state", None)
    base = getattr(model, "model", model) if isinstance(state, dict) else model
    if isinstance(base, lora.AdapterView):
        if bad := first_non_finite(state if isinstance(state, dict) else base.state_dict()):
            raise NonFinite(bad)
        base.save_pretrained(directory, state_dict=state)
        return {f.name: _listed(f) for f in sorted(directory.iterdir())}
    tied = tied_keys(base)
    state = state if isinstance(state, dict) else base.state_dict()
    tensors = _unaliased(state, set() if untie else tied)
    if untie and tied:  # each tied name its own storage: safetensors refuses aliases
        tensors = {k: t.clone() if k in tied else t for k, t in tensors.items()}
    if dtype is not None:
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
    hashes, size = tensorfile.write(directory / WEIGHTS_FILE, tensors, {"format": "pt"}, finite_only=True)

    def written_config() -> str:
        config = base.config
        if untie and tied:
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
        if dtype is not None:
            config = copy.deepcopy(config) if config is base.config else config
            config.dtype = dtype  # transformers 5 (``torch_dtype`` in 4.x reads the same attribute)
        return config.to_json_string()

    key = (bool(untie and tied), str(dtype))
    (directory / "config.json").write_text(_json_text(base.config, key, written_config), encoding="utf-8")
    generation = getattr(base, "generation_config", None)
    if generation is not None and base.can_generate():
        text = _json_text(generation, (), generation.to_json_string)
        (directory / "generation_config.json").write_text(text, encoding="utf-8")
    files = {WEIGHTS_FILE: {"bytes": size, "pieces": hashes}}
    for f in sorted(directory.glob("*.json")):
        files[f.name] = _listed(f)
    return files


def _listed(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "pieces": pieces.of_file(path)}


def first_non_finite(state: dict) -> str | None:
    """The name of the first floating tensor of ``state`` that holds inf or NaN, or None."""
    for name, t in state.items():
        if t.is_floating_point() and t.numel() and not tensorfile.finite(t):
            return name
    return None


def _unaliased(state: dict, tied: set[str]) -> dict:
    """Each storage once (safetensors refuses aliases), keeping the name that is not tied."""
    by_ptr: dict[int, str] = {}
    for name, t in state.items():
        ptr = t.data_ptr() if t.numel() else id(t)
        kept = by_ptr.get(ptr)
        if kept is None or (kept in tied and name not in tied):
            by_ptr[ptr] = name
    keep = set(by_ptr.values())
    return {n: t for n, t in state.items() if n in keep}


def _write_manifest(directory: Path, version: int, files: dict) -> str:
    """Write the manifest of ``files`` ({name: {bytes, pieces}}), each as it is now on disk;
    its sha256 hex."""
    for name, entry in files.items():
        entry["written"] = _as_written(directory / name)
    doc = {"format": MANIFEST_FORMAT, "version": version, "piece_bytes": pieces.PIECE, "files": files}
    doc["piece_hash"] = pieces.HASH  # for people reading it: the format decides
    doc["written_by"] = this_boot()
    raw = json.dumps(doc, indent=1, sort_keys=True).encode()
    (directory / MANIFEST).write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def _as_written(path: Path) -> list[int]:
    """What changes whenever a file's bytes do (a write, a truncation, a replacement; setting
    its times back changes its change time): inode, modification and change times, in ns."""
    st = path.stat()
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def this_boot() -> dict[str, str]:
    """This machine and the boot it is in (``boot_id`` empty where the kernel has none).

    A version is renamed into place without fsync: its bytes can be lost only by a machine
    crash, and then the machine has rebooted since. Containers on one machine share its
    boot id (and its page cache)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return {"host": socket.gethostname(), "boot_id": boot_id}


def read_manifest(path: Path, sha256: str) -> dict:
    """``path``'s manifest, once its bytes hash to ``sha256`` (the announced one) and it is
    this build's format: {"files": {name: (bytes, [piece hash], as written)}, "piece": bytes a
    piece, "written_by": ...}. Raises WeightsError."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError as e:
        raise WeightsError(f"{path}: cannot read {MANIFEST} ({e.strerror})") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    form = doc.get("format") if isinstance(doc, dict) else None
    if form is not None and form != MANIFEST_FORMAT:  # another build's trainer wrote it
        raise WeightsError(
            f"{path}: {MANIFEST} is format {form!r}, this build reads {MANIFEST_FORMAT}: "
            "run the same streamer in the trainer and every reader"
        )
    if (actual := hashlib.sha256(raw).hexdigest()) != sha256:
        raise WeightsError(f"sha256 mismatch ({MANIFEST} hashes to {actual[:12]}..., not {sha256[:12]}...)")
    try:
        piece = int(doc["piece_bytes"])
        files = {
            str(k): (int(v["bytes"]), [str(h) for h in v["pieces"]], [int(x) for x in v["written"]])
            for k, v in doc["files"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError):
        raise WeightsError(f"{path}: unreadable {MANIFEST}") from None
    for name, (size, hashes, _) in files.items():
        if piece <= 0 or "/" in name or name in ("", ".", "..") or len(hashes) != -(-size // piece):
            raise WeightsError(f"{path}: unreadable {MANIFEST} (entry {name!r})")
    return {"files": files, "piece": piece, "written_by": doc.get("written_by")}


def check_files(path: Path, manifest: dict, *, hashed: bool) -> None:
    """WeightsError unless every file of ``manifest`` is in ``path`` at its size, and no other
    safetensors file; ``hashed``: and every piece hashes to its listed hash."""
    files = manifest["files"]
    on_disk = {f.name for f in path.glob("*.safetensors")}
    listed = {f for f in files if f.endswith(".safetensors")}
    if on_disk != listed or not listed:
        raise WeightsError(f"{path}: safetensors files {sorted(on_disk)} != {MANIFEST}'s {sorted(listed)}")
    for name, (size, _, _) in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            actual = -1
        if actual != size:
            raise WeightsError(f"{path}/{name}: {actual} bytes, {MANIFEST} says {size}")
    if not hashed:
        return
    piece = manifest["piece"]
    for name, (size, hashes, _) in files.items():
        for k, (got, want) in enumerate(zip(pieces.of_file(path / name, piece), hashes)):
            if got != want:
                end = min(size, (k + 1) * piece)
                raise WeightsError(f"{path}/{name}: {pieces.HASH} mismatch in bytes {k * piece}-{end}")


def check_manifest(path: Path, sha256: str) -> bool:
    """Whether ``path``'s manifest vouches for its files: it hashes to ``sha256``, every file
    is there at its listed size, and, in the boot it was written in, every file is as the
    writer left it, so the pieces hashed as they were written stand for the bytes. False
    when that cannot be told (another machine, a reboot since, a file written to since): then
    the caller re-hashes them. Raises WeightsError on a mismatch.
    """
    manifest = read_manifest(path, sha256)
    check_files(path, manifest, hashed=False)
    return _as_left(path, manifest)


def _as_left(path: Path, manifest: dict) -> bool:
    """Whether this is the boot ``manifest`` was written in and every file of it is as the
    writer left it."""
    by, boot = manifest["written_by"], this_boot()["boot_id"]
    if not boot or not isinstance(by, dict) or by.get("boot_id") != boot:
        return False
    try:
        return all(_as_written(path / name) == written for name, (_, _, written) in manifest["files"].items())
    except OSError:  # a file gone: check_files names it
        return False


def versions(root: Path) -> list[int]:
    """Version numbers with a weights directory under ``root``, ascending."""
    return [v for v, _ in numbered(root, _NAME)]


def prune(root: Path, keep: int, protect: tuple[int, ...] = ()) -> list[int]:
    """Delete all but the newest ``keep`` versions (and stale temp dirs); returns deleted."""
    if not Path(root).exists():
        return []
    remove_unfinished(root)
    doomed = [v for v in versions(root)[:-keep] if v not in protect] if keep > 0 else []
    for v in doomed:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    return doomed


def resolve(sync: WeightSync, root: Path, *, check_sha: bool = True, verify: str = "manifest") -> Path:
    """The local directory of ``sync``'s weights, refusing anything outside ``root``.

    ``verify="manifest"``: the directory's manifest must hash to ``sync.sha256`` and list
    every file at its size, and every piece is re-hashed unless the files are as the writer
    left them in this boot (as :func:`check_manifest` tells); ``"full"``: every piece is
    re-hashed (weights that crossed untrusted storage).
    """
    parts = urllib.parse.urlsplit(sync.uri)
    if parts.scheme != "file":
        raise WeightsError(f"version {sync.version}: unsupported weights uri {sync.uri!r}")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    root = Path(root).resolve()
    if not path.is_relative_to(root):
        raise WeightsError(f"version {sync.version}: weights {path} are outside {root}")
    if not path.is_dir():
        raise WeightsError(f"version {sync.version}: weights directory {path} does not exist")
    if not check_sha:
        return path
    if verify not in VERIFY_MODES:
        raise WeightsError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    try:
        manifest = read_manifest(path, sync.sha256)
        check_files(path, manifest, hashed=verify == "full" or not _as_left(path, manifest))
    except WeightsError as e:
        raise WeightsError(f"version {sync.version}: {e}") from None
    return path


def load_into(model, directory: Path, *, mapped: bool = False) -> None:
    """Load a version directory's safetensors into ``model`` in place (strict, tied-aware).
    ``mapped`` (a sampler's model): a CPU model of the files' dtype points at the files'
    bytes instead of copying them (streamer/tensorfile.py).

    A LoRA adapter directory (streamer/lora.py) is loaded into the model's adapter.
    """
    from streamer import lora

    if lora.is_adapter(directory):
        try:
            lora.load_adapter_state(model, directory)
        except lora.AdapterError as e:
            raise WeightsError(str(e)) from None
        return

    # the model's own tensors (state_dict's are detached: pointing them elsewhere does nothing)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    files = sorted(Path(directory).glob("*.safetensors"))
    names = set().union(*(tensorfile.header(f)[0].keys() for f in files))
    _check_fits(model, model.state_dict().keys(), names, directory)
    for f in files:
        tensorfile.load_into(targets, f, mapped=mapped)
    if tied_keys(model):
        model.tie_weights()


def read_full(model, directory: Path) -> dict:
    """A version directory's tensors as a full state dict for ``model`` (a sharded one: FSDP),
    checked like :func:`load_into`; tied copies the files leave out are left out here too."""
    from safetensors.torch import load_file

    out = {k: t for f in sorted(Path(directory).glob("*.safetensors")) for k, t in load_file(f).items()}
    _check_fits(model, model.state_dict().keys(), out.keys(), directory)
    return out


def _check_fits(model, params, names, directory: Path) -> None:
    """WeightsError unless the files' tensor ``names`` are the model's ``params`` (tied copies
    may be left out) and there was at least one file."""
    missing = [k for k in params if k not in names and k not in tied_keys(model)]
    unexpected = sorted(set(names) - set(params))
    if missing or unexpected or not names:
        raise WeightsError(
            f"weights in {directory} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def tied_keys(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(keys, dict):  # transformers 5: {target: source}
        keys = keys.keys()
    return set(keys) if getattr(model.config, "tie_word_embeddings", False) else set()
