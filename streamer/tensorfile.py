"""safetensors files written and hashed in one pass, and loaded with one copy.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, then the
raw tensor bytes. Writing it here rather than through ``save_pretrained`` lets the writer
hash the bytes as it writes them, piece by piece on several threads (streamer/pieces.py),
instead of reading the file back to hash it afterwards.
Loading maps the file and copies each tensor straight into the model's parameter, or, for a
sampler, points the parameter at the mapped bytes (``load_file`` + ``load_state_dict`` copy
every byte twice). The reader checks the header
(known dtypes, offsets inside the file, sizes that match the shapes) before touching data;
it never unpickles anything.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch

from streamer import pieces
from streamer.errors import WeightsError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # as safetensors itself


def write(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    finite_only: bool = False,
):
    """Write ``tensors`` to ``path`` as safetensors; (the hash of each of its pieces
    (streamer/pieces.py), bytes written).

    ``finite_only``: every floating tensor is checked for inf and NaN in the same pass, a slice at
    a time on the writing threads just before it is written; :class:`NonFinite` (naming the
    tensor) stops the write, leaving an incomplete file for the caller to discard."""
    blobs, header, offset, flat = [], {}, 0, [None]
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise WeightsError(f"tensor {name}: dtype {t.dtype} cannot be saved")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        flat.append((name, t.reshape(-1)) if t.is_floating_point() and t.numel() else None)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def check(index: int, begin: int, end: int) -> None:
        if (entry := flat[index]) is None:
            return
        name, t = entry
        size = t.element_size()  # the elements that begin in these bytes (one may end past them)
        if (first := -(-begin // size)) < (stop := -(-end // size)) and not finite(t[first:stop]):
            raise NonFinite(name)

    return pieces.write(path, [struct.pack("<Q", len(head)) + head, *blobs], check if finite_only else None)


class NonFinite(WeightsError):
    """A floating tensor holds inf or NaN (weights that would only sample garbage)."""

    def __init__(self, tensor: str):
        super().__init__(f"tensor {tensor!r} holds inf or NaN")
        self.tensor = tensor


def header(path: Path) -> tuple[dict, int]:
    """The checked header of a safetensors file and where its data begins."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WeightsError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise WeightsError(f"{path}: header length {n} does not fit the file")
        try:
            head = json.loads(f.read(n))
        except ValueError as e:
            raise WeightsError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(head, dict):
        raise WeightsError(f"{path}: header is not a JSON object")
    head.pop("__metadata__", None)
    data = size - 8 - n
    for name, spec in head.items():
        _check(path, name, spec, data)
    return head, 8 + n


def _check(path: Path, name: str, spec, data_bytes: int) -> None:
    try:
        dtype = DTYPES[spec["dtype"]]
        begin, end = (int(x) for x in spec["data_offsets"])
        count = math.prod(int(d) for d in spec["shape"])
    except (KeyError, TypeError, ValueError):
        raise WeightsError(f"{path}: tensor {name!r} has a malformed header entry") from None
    if not 0 <= begin <= end <= data_bytes or end - begin != count * dtype.itemsize:
        raise WeightsError(f"{path}: tensor {name!r} has offsets that do not match its shape or the file")


def load_into(targets: dict[str, torch.Tensor], path: Path, *, mapped: bool = False) -> set[str]:
    """Load every tensor of the file into ``targets[name]`` (a model's parameters and buffers,
    by their state-dict names); the names it held.

    ``mapped`` (a sampler's weights, read and never written): a CPU target of the file's dtype
    takes the file's bytes without a copy: its ``.data`` becomes a view of the file mapped
    copy-on-write (every reader of a file shares its page cache; the file may be deleted
    meanwhile, its space freed once no view is left). Any other target is copied into in
    place: a floating tensor cast to the target's floating dtype (a float32 file into a
    bfloat16 model), or onto its device. Raises WeightsError (before changing anything) for a
    name not in ``targets``, a shape that differs, or a dtype that cannot be cast (integer
    against float). The values are not looked at: a policy version is checked for inf and NaN
    as it is written, and its reader makes sure these are still the bytes written
    (streamer/weights.py).
    """
    head, start = header(path)
    for name, spec in head.items():
        target = targets.get(name)
        if target is None:
            raise WeightsError(f"{path}: tensor {name!r} is not a parameter of the model")
        source = DTYPES[spec["dtype"]]
        castable = source == target.dtype or (source.is_floating_point and target.dtype.is_floating_point)
        if list(target.shape) != list(spec["shape"]) or not castable:
            raise WeightsError(
                f"{path}: tensor {name!r} is {spec['dtype']}{spec['shape']}, the model's "
                f"{target.dtype}{list(target.shape)}"
            )
    spans = [
        (name, DTYPES[spec["dtype"]], start + spec["data_offsets"][0], start + spec["data_offsets"][1])
        for name, spec in head.items()
        if spec["data_offsets"][1] > spec["data_offsets"][0]
    ]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    shared = False
    with torch.no_grad():
        for name, dtype, begin, end in spans:
            target = targets[name]
            view = _view(mm, dtype, begin, end - begin).view(target.shape)
            if (
                mapped
                and target.device.type == "cpu"
                and target.dtype == dtype
                and begin % dtype.itemsize == 0
            ):
                target.data, shared = view, True
            else:
                target.copy_(view)  # casts float to float
            del view
    if not shared:
        mm.close()
    return set(head)


def _view(mm: mmap.mmap, dtype: torch.dtype, offset: int, nbytes: int) -> torch.Tensor:
    # the map stays open while a view lives (an exported buffer cannot be unmapped)
    return torch.frombuffer(mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)


def finite(t: torch.Tensor) -> bool:
    """Whether a non-empty floating tensor holds no inf or NaN. Its sum first (NaN and inf
    propagate, so a finite sum means finite elements): one reduction, ~2x faster than
    ``aminmax`` (0.03 s against 0.06 s for 100M floats on one core here), and far faster than
    ``isfinite(t).all()``, which writes a bool per element (0.29 s for 50M). A sum that is
    not finite may have overflowed: then its min and max decide (both propagate NaN)."""
    if bool(torch.isfinite(t.sum())):
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
