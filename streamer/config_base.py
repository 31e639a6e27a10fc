"""What every config section is, and the bounded numbers its fields use.

A section is a frozen Struct that rejects unknown keys; the bounds are checked where the
types are: by the TOML decoder, and by ``config.replace`` (CLI overrides).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A config table: keyword-only fields with defaults; an unknown key is an error."""
