"""LoRA adapters (``[model.lora]``, via ``peft``): train, publish and load the adapter only.

With ``model.lora.rank > 0`` the trainer wraps the policy in a ``peft`` LoRA model: the base
weights are frozen and only the adapter (rank r matrices A and B per target layer, scaled
by alpha / r) is trained, so the optimizer state and every published version are the
adapter's size, megabytes instead of the model's gigabytes. A version directory then holds
``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's layout, loadable by
``PeftModel.from_pretrained``, vLLM's and SGLang's LoRA loading); checkpoints hold the same
plus the adapter's optimizer state. Every process loads the base from ``model`` (same name,
same seed) and applies the adapter on top: the local sampler wraps its model on the first
adapter version and swaps the adapter's tensors in place after that; the remote sampler
asks the server to load the adapter (see producers/remote_sampler.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from streamer.config import LoraSection
from streamer.errors import AdapterError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter(directory: Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply(model, cfg: LoraSection):
    """``model`` wrapped for LoRA training: base frozen, adapter trainable (a PeftModel)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules) or "all-linear",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info(
        "LoRA rank %d: training %d of %d parameters (%.2f%%)",
        cfg.rank,
        trainable,
        total,
        100 * trainable / total,
    )
    return peft_model


def load_adapter(model, directory: Path):
    """Apply the adapter in ``directory`` to ``model``; returns the model to use from now on.

    A plain model is wrapped (once); a model already wrapped gets the new adapter tensors
    in place. Raises AdapterError when the adapter's tensors do not match the model's.
    """
    directory = Path(directory)
    if not is_peft(model):
        # not PeftModel.from_pretrained: it falls back to torch.load of adapter_model.bin
        from peft import LoraConfig, get_peft_model

        saved = json.loads((directory / ADAPTER_CONFIG).read_text())
        keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "fan_in_fan_out")
        config = LoraConfig(task_type="CAUSAL_LM", **{k: saved[k] for k in keys if k in saved})
        model = get_peft_model(model, config).requires_grad_(False)
        log.info("applied LoRA adapter from %s (rank %d)", directory, config.r)
    load_adapter_state(model, directory)
    return model.eval()


def load_adapter_state(model, directory: Path) -> None:
    """Copy the adapter tensors of ``directory`` into a PeftModel, checking they all fit."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not is_peft(model):
        raise AdapterError(f"{directory} holds a LoRA adapter but the model has none (set [model.lora])")
    config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    ours = model.peft_config["default"]
    if int(config.get("r", -1)) != ours.r:
        raise AdapterError(f"adapter in {directory} has rank {config.get('r')}, the model's has {ours.r}")
    device = next(model.parameters()).device
    state = load_file(str(Path(directory) / ADAPTER_WEIGHTS), device=str(device))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise AdapterError(
            f"adapter in {directory} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


class AdapterView:
    """What gets published for a LoRA policy: only the adapter's tensors, saved in PEFT layout.

    Quacks like the model for the version writer and checkpoints (``state_dict``,
    ``save_pretrained``), so a snapshot copies megabytes, not the frozen base.
    """

    def __init__(self, peft_model):
        self.model = peft_model

    def state_dict(self) -> dict:
        return {k: v for k, v in self.model.state_dict().items() if "lora_" in k}

    def save_pretrained(self, path, state_dict=None, **kwargs) -> None:
        self.model.save_pretrained(path, state_dict=state_dict or self.state_dict(), **kwargs)
        (Path(path) / "README.md").unlink(missing_ok=True)  # peft's model card: not part of a version

    def parameters(self):
        return self.model.parameters()
