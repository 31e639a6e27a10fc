"""Render the config reference (every key, type, default, one line) from the config Structs."""

from __future__ import annotations

import inspect
import re

import msgspec

from streamer import config

_FIELD_RE = re.compile(r"^\s+(\w+): (.+?) = .*?#\s*(.+)$")


def _comments(cls: type) -> dict[str, tuple[str, str]]:
    out = {}
    for line in inspect.getsource(cls).splitlines():
        if m := _FIELD_RE.match(line):
            out[m.group(1)] = (m.group(2), m.group(3).strip())
    return out


def _rows(prefix: str, obj: msgspec.Struct) -> list[str]:
    """One row per field of ``obj``; a nested section's fields follow under its dotted name."""
    notes = _comments(type(obj))
    rows = []
    for f in msgspec.structs.fields(type(obj)):
        value = getattr(obj, f.name)
        if isinstance(value, msgspec.Struct):
            rows.extend(_rows(f"{prefix}.{f.name}", value))
            continue
        typ, doc = notes.get(f.name, ("", ""))
        rows.append(f"| `{prefix}.{f.name}` | `{typ}` | `{value!r}` | {doc} |".replace("`''`", '`""`'))
    return rows


def _loss_table() -> list[str]:
    lines = [
        "",
        "Which keys each `trainer.loss` reads (all of them also read `trainer.loss_agg` and `trainer.kl_coef`):",
        "",
    ]
    lines += ["| `trainer.loss` | keys |", "| --- | --- |"]
    for name, keys in config.LOSS_KEYS.items():
        lines.append(f"| `{name}` | {', '.join(f'`trainer.{k}`' for k in keys) or 'none'} |")
    lines += [
        "",
        '`loss_agg = "seq-mean"` averages each sequence\'s trained tokens, then divides by the number '
        "of sequences with at least one trained token (not by all rows): a fully masked sample does "
        "not dilute the mean.",
    ]
    return lines


def render() -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    root = config.RunConfig()
    for section in msgspec.structs.fields(config.RunConfig):
        lines.extend(_rows(section.name, getattr(root, section.name)))
    return "\n".join(lines + _loss_table())


START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def sync(path, *, check: bool) -> bool:
    """Put the reference between the markers of ``path``; with ``check``, only compare.

    Returns whether the file was (or, with ``check``, is) up to date.
    """
    from pathlib import Path

    text = Path(path).read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise ValueError(f"{path} has no {START} marker")
    fresh = f"{head}{START}\n{render()}\n{END}{tail}"
    if check:
        return fresh == text
    Path(path).write_text(fresh)
    return True
