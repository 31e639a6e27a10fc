"""What the environment modules share: their names in a config, and importing an optional
package with a clear error naming the extra that brings it."""

from __future__ import annotations

import importlib
from types import ModuleType

from streamer.errors import ConfigError

EXTRA = "envs"
REWARDS = ("math", "reasoning_gym")  # reward names that are not import paths
ROLLOUT_PREFIX = "verifiers:"
GYM_PREFIX = "reasoning_gym:"


def need(module: str, package: str, *, what: str) -> ModuleType:
    """``module``, imported; a ConfigError naming ``what`` needs it and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{what} needs the {package} package ({e}): pip install 'streamer-rl[{EXTRA}]'"
        ) from None
