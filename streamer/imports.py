"""Load a user's function named by import path in a config (rewards, rollouts, filters, advantages)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from streamer.errors import ConfigError


def load_function(path: str, *, what: str, dotted: bool = False) -> Callable:
    """Import ``"package.module:function"`` (also ``"package.module.function"`` with ``dotted``);
    a ConfigError naming ``what`` (the config key) and what is wrong otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep and dotted:
        module_name, _, attr = path.rpartition(".")
    if not (sep or dotted) or not module_name or not attr:
        raise ConfigError(f'{what} {path!r}: expected "module:function"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {path!r}: {module_name} has no function {attr!r}")
    return fn
