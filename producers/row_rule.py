"""The rule every dataset row keeps, and the plain JSONL reader.

A row has ``messages`` (a chat: a non-empty list of ``{"role", "content"}`` strings) or
``prompt`` (a non-empty string); when it has both, ``messages`` is the one checked (and
rendered). A JSONL file is one JSON object per line, blank lines skipped; a line that is
not such a row is a :class:`DatasetError` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from streamer.errors import DatasetError


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSONL file, in memory."""
    rows = [parse_row(line, where=f"{path}:{lineno}") for lineno, line in jsonl_lines(path)]
    if not rows:
        raise DatasetError(f"{path}: no rows (expected one JSON object per line)")
    return rows


def jsonl_lines(path: Path):
    """(line number, line) of each line of ``path`` that is not blank, read as it goes."""
    try:
        with path.open(encoding="utf-8") as f:
            yield from ((n, line) for n, line in enumerate(f, start=1) if line.strip())
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_row(line: str, *, where: str) -> dict:
    """One JSONL line as a row dict, or a DatasetError that starts with ``where``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    check_row(row, where=where)
    return row


def check_row(row: dict, *, where: str) -> None:
    """The row rule: ``messages`` (a non-empty chat) or ``prompt`` (a non-empty string)."""
    if "messages" in row:
        _check_messages(row["messages"], where)
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DatasetError(f"{where}: `prompt` must be a non-empty string")
    else:
        raise DatasetError(f"{where}: a row needs `messages` (a chat) or `prompt` (a string)")


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: `messages` must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DatasetError(f"{where}: messages[{i}] needs a string `role`")
        if not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: messages[{i}] needs a string `content`")
