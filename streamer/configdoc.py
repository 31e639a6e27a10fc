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


def render() -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    root = config.RunConfig()
    for section in msgspec.structs.fields(config.RunConfig):
        obj = getattr(root, section.name)
        notes = _comments(type(obj))
        for f in msgspec.structs.fields(type(obj)):
            typ, doc = notes.get(f.name, ("", ""))
            default = getattr(obj, f.name)
            lines.append(
                f"| `{section.name}.{f.name}` | `{typ}` | `{default!r}` | {doc} |".replace("`''`", '`""`')
            )
    return "\n".join(lines)


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
