"""Mixed precision that trains: fp32 master weights and AdamW state, half-precision compute.

Why not train the weights in half precision: in float16, Adam's second moment underflows
and ``eps`` (1e-8) rounds to 0, so one step turns most weights to NaN; in bfloat16 an
update of lr * ~1 is below the 8-bit mantissa's resolution for most weights, so training
silently does almost nothing (or, at larger lr, moves them in coarse jumps). So the
trainer always keeps its weights and optimizer state in float32 and runs the forward and
backward passes under ``torch.autocast`` in the compute dtype:

    trainer.precision   compute dtype
    "auto"              model.dtype when it is bfloat16/float16; else bfloat16 on CUDA, float32 on CPU
    "float32"           no autocast
    "bfloat16"          autocast bfloat16 (rejected on a GPU without bf16 support)
    "float16"           autocast float16 with a dynamic loss scale (torch.amp.GradScaler)

A step whose gradient is not finite (after unscaling) is skipped, not applied: the
weights and the optimizer state stay as they were and the skip is counted (with float16
the loss scale is also lowered, which is how the scaler finds its range). ``model.dtype``
still sets the dtype samplers and the evaluator load, and each published version is
written in it (the float32 master weights cast, consumers/versions.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from streamer.errors import ConfigError

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


def to_master(model) -> torch.dtype:
    """Cast ``model``'s floating parameters to float32 in place; returns the dtype it had."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    loaded = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    if dtypes - {torch.float32}:
        model.float()
        log.info("training %s weights as float32 master weights (autocast for compute)", loaded)
    return loaded


def compute_dtype(setting: str, *, device: torch.device, loaded: torch.dtype) -> torch.dtype:
    """The autocast dtype ``trainer.precision`` means here (ConfigError if it cannot train)."""
    if setting == "auto":
        if loaded in HALF:
            return loaded
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(setting)
    if dtype is None:
        raise ConfigError(f"`trainer.precision` must be auto, float32, bfloat16 or float16, got {setting!r}")
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError('`trainer.precision = "bfloat16"`: this GPU has no bfloat16; use "float16"')
    return dtype


class Precision:
    """Autocast, (scaled) backward and a guarded optimizer step for one device and dtype."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self.skipped = 0  # optimizer steps skipped for a non-finite gradient, in total

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params, grad_clip: float) -> tuple[float, bool]:
        """Clip and apply the accumulated gradient; (grad norm, whether the step was skipped)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        finite = torch.isfinite(torch.tensor(grad_norm)).item()
        if finite:
            if self.scaler is not None:
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        else:
            self.skipped += 1
            log.warning(
                "non-finite gradient (norm %s): optimizer step skipped (%d so far)", grad_norm, self.skipped
            )
        if self.scaler is not None:
            self.scaler.update()
        return grad_norm, not finite
