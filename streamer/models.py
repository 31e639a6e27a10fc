"""Load tokenizers and causal LMs by config: the built-in demo, a hub id or a local path."""

from __future__ import annotations

from pathlib import Path

from streamer import demo
from streamer.config import ModelSection


def device(cfg: ModelSection) -> str:
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(cfg: ModelSection):
    name = cfg.tokenizer or cfg.name_or_path
    if name == demo.DEMO:
        return demo.tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)


def load_decoder(cfg: ModelSection):
    """A tokenizer for token ids -> text only (``decode(ids, skip_special_tokens=...)``),
    without transformers (which imports torch) where it can be: the demo's
    (:func:`streamer.demo.decoder`), or a local directory's ``tokenizer.json`` through the
    ``tokenizers`` library (what transformers' fast tokenizers decode with; a tokenizer that
    asks for ``clean_up_tokenization_spaces`` would differ in spaces); else
    :func:`load_tokenizer`'s."""
    name = cfg.tokenizer or cfg.name_or_path
    if name == demo.DEMO:
        return demo.decoder()
    if (path := Path(name) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    return load_tokenizer(cfg)


def load_model(cfg: ModelSection, *, seed: int = 0, dev: str | None = None):
    """The initial policy (eval mode, on ``dev`` or the configured device)."""
    import torch

    dtype = getattr(torch, cfg.dtype)
    if cfg.name_or_path == demo.DEMO:
        model = demo.build_model(seed).to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code
        )
    return model.to(dev or device(cfg)).eval()
