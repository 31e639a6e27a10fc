"""Render the config reference (every key, type, default, one line) from the config Structs."""

from __future__ import annotations

import inspect
import re

import msgspec

from streamer import config, config_trainer

# `name: type = default  # meaning`, or the formatter's wrapped form of a long line:
# `name: type = (\n    default  # meaning\n)`
_FIELD_RE = re.compile(r"^ +(\w+): .+? = (?:\(\n +)?.*?# *(.+)$", re.M)


def _comments(cls: type) -> dict[str, str]:
    return {m.group(1): m.group(2).strip() for m in _FIELD_RE.finditer(inspect.getsource(cls))}


def _type(t: msgspec.inspect.Type) -> str:
    """A field's type as a reader wants it: ``int > 0``, ``float in [0, 1)``, ``"a" / "b"``."""
    if isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    if isinstance(t, msgspec.inspect.LiteralType):
        return " / ".join(f'"{v}"' for v in t.values)  # not "|": it would end the table cell
    if isinstance(t, msgspec.inspect.ListType):
        return f"list[{_type(t.item_type)}]"
    if isinstance(t, msgspec.inspect.StructType):
        return "table"
    name = type(t).__name__.removesuffix("Type").lower()
    ops = ((">", "gt"), (">=", "ge"), ("<", "lt"), ("<=", "le"))
    bounds = [(op, v) for op, key in ops if (v := getattr(t, key, None)) is not None]
    if len(bounds) == 2:  # msgspec takes at most one per side: a lower and an upper bound
        (lo_op, lo), (hi_op, hi) = bounds
        return f"{name} in {'(' if lo_op == '>' else '['}{lo}, {hi}{')' if hi_op == '<' else ']'}"
    return " ".join([name, *(f"{op} {v}" for op, v in bounds)])


def _rows(prefix: str, obj: msgspec.Struct) -> list[str]:
    """One row per field of ``obj``; a nested section's fields follow under its dotted name."""
    notes = _comments(type(obj))
    types = {f.name: f.type for f in msgspec.inspect.type_info(type(obj)).fields}
    rows = []
    for f in msgspec.structs.fields(type(obj)):
        value = getattr(obj, f.name)
        if isinstance(value, msgspec.Struct):
            rows.extend(_rows(f"{prefix}.{f.name}", value))
            continue
        row = f"| `{prefix}.{f.name}` | `{_type(types[f.name])}` | `{value!r}` | {notes.get(f.name, '')} |"
        rows.append(row.replace("`''`", '`""`'))
        table = types[f.name]
        if isinstance(table, msgspec.inspect.DictType) and isinstance(
            table.value_type, msgspec.inspect.StructType
        ):
            rows.extend(_table_rows(f"{prefix}.{f.name}.NAME", table.value_type.cls))
        if isinstance(table, msgspec.inspect.ListType) and isinstance(
            table.item_type, msgspec.inspect.StructType
        ):
            rows.extend(_table_rows(f"{prefix}.{f.name}[]", table.item_type.cls))  # [[dataset.sources]]
    return rows


def _table_rows(prefix: str, cls: type) -> list[str]:
    """The fields of a table or array of sections (``[eval.sets.NAME]``, ``[[dataset.sources]]``),
    with their defaults."""
    notes = _comments(cls)
    out = []
    for f in msgspec.inspect.type_info(cls).fields:
        default = "required" if f.required else repr(f.default)
        row = f"| `{prefix}.{f.name}` | `{_type(f.type)}` | `{default}` | {notes.get(f.name, '')} |"
        out.append(row.replace("`''`", '`""`'))
    return out


def _loss_table() -> list[str]:
    lines = [
        "",
        "Which keys each `trainer.loss` reads (all of them also read `trainer.loss_agg` and `trainer.kl_coef`):",
        "",
    ]
    lines += ["| `trainer.loss` | keys |", "| --- | --- |"]
    for name, keys in config_trainer.LOSS_KEYS.items():
        lines.append(f"| `{name}` | {', '.join(f'`trainer.{k}`' for k in keys) or 'none'} |")
    lines += [
        '| `"module:function"` | none: a loss of one\'s own, called like the built-ins '
        "(signature in consumers/losses/terms.py) |",
        "",
        '`loss_agg = "auto"` is `seq-mean` for '
        + ", ".join(f"`{n}`" for n in config_trainer.SEQ_MEAN_LOSSES)
        + " (a sequence-level objective: token-mean would weigh each sequence by its length) and "
        "`token-mean` for every other loss. "
        "`seq-mean` averages each sequence's trained tokens, then divides by the number "
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
