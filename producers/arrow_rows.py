"""Rows of files too large to hold: Arrow through HF ``datasets``, a row read when asked for.

A parquet or JSONL file is converted once into Arrow under the cache directory
(``dataset.cache_dir``, by default ``{run.data_dir}/datasets``, keyed by the file's path
and modification time: a changed file is converted again); an Arrow stream file (what
``datasets`` writes) is used where it lies, an Arrow IPC file is converted; a directory is
its parquet, Arrow and JSONL files in name order (a ``save_to_disk`` directory is loaded
as such); a hub dataset ``hf:owner/name[/config][:split]`` is downloaded and prepared
into the same cache. Every producer then memory-maps the Arrow: the rows stay in the page
cache, shared by the processes of a machine, and a row becomes a dict only when a ticket
points at it, so a producer's own memory does not grow with the dataset.

Arrow gives every row every column: a column a row lacks is null there, and a null reads
as absent (a row's dict leaves it out, inside ``messages`` too), so a JSONL row read this
way is the dict it was, less its explicit nulls. A JSONL column holding both integers and
fractions is kept as JSON (Arrow would make ``4`` a ``4.0``, and ``str(answer)`` with it).

The row rule and the reward's fields are checked column by column before any work starts
(a few passes over the mapped columns, not a dict per row); the first row that breaks the
rule is read and its error is the one a JSONL line would give.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from producers.lazy_rows import Concat, Rows
from producers.row_rule import check_row, jsonl_lines, read_jsonl
from streamer.config_dataset import hub_name
from streamer.errors import DatasetError

log = logging.getLogger(__name__)

BATCH = 1 << 16  # rows per slice of a column the checks hold at once
# rows per record batch of a conversion: opening the Arrow reads every batch's header, and
# each read maps the pages around it (64 KB), so datasets' 1,000 would map ~40 % of a file
# of short rows at once; the conversion holds this many rows in memory
WRITER_BATCH = 10_000
SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")  # the files of a directory that are read


def load_path(path: Path, *, cache_dir: str | Path | None) -> Rows:
    """A file or a directory of them as rows (see the module's docstring)."""
    cache = str(cache_dir) if cache_dir is not None else None
    if not path.exists():
        hint = " (a hub dataset is hf:owner/name)" if not path.suffix and len(path.parts) == 2 else ""
        raise DatasetError(f"cannot read dataset {path}: no such file or directory{hint}")
    if path.is_dir():
        return _directory(path, cache)
    started = time.monotonic()
    datasets.disable_progress_bars()  # a conversion logs one line; bars would fill the logs
    if path.suffix == ".parquet":
        convert = functools.partial(
            datasets.Dataset.from_parquet, str(path), cache_dir=cache, writer_batch_size=WRITER_BATCH
        )
        rows = ArrowRows(_converted(path, convert), str(path))
    elif path.suffix == ".arrow":
        rows = ArrowRows(_arrow_file(path, cache), str(path))
    else:
        rows = ArrowRows(_jsonl(path, cache), str(path), jsonl=path)
    pa.default_memory_pool().release_unused()  # a conversion's buffers: the pool would keep them
    log.info("%s: %d rows, memory-mapped (%.1fs)", path, len(rows), time.monotonic() - started)
    return rows


def load_hub(source: str, *, split: str, cache_dir: str | Path | None) -> Rows:
    """A hub dataset's split; a DatasetError that says what went wrong (no network, no such
    dataset or split)."""
    try:
        hub = hub_name(source)
    except ValueError as e:
        raise DatasetError(str(e)) from None
    split = hub.split or split
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            hub.repo,
            hub.config or None,
            split=split,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            writer_batch_size=WRITER_BATCH,
        )
    except ConnectionError as e:  # no network, or offline mode and not in the cache
        raise DatasetError(
            f"cannot load {source} from the hub: {e}. It needs a network that reaches huggingface.co "
            "(or HF_ENDPOINT); one loaded before loads offline with HF_HUB_OFFLINE=1"
        ) from None
    except Exception as e:  # datasets' own errors: no such dataset, config or split
        raise DatasetError(f"cannot load {source} (split {split!r}): {type(e).__name__}: {e}") from None
    pa.default_memory_pool().release_unused()
    return ArrowRows(ds, source if hub.split else f"{source}:{split}")


class ArrowRows(Rows):
    """The rows of one ``datasets.Dataset``, checked against the row rule when made."""

    def __init__(self, ds: datasets.Dataset, label: str, *, jsonl: Path | None = None):
        if len(ds) == 0:
            raise DatasetError(f"{label}: no rows")
        self.ds, self.label, self.jsonl = ds, label, jsonl
        self.table: pa.Table = ds.data.table  # memory-mapped: slicing and null counts read no rows
        if not _standard(self.table.schema):  # a `messages` of JSON, say: row by row
            log.info("%s: checking %d rows one by one (`prompt`/`messages` of other types)", label, len(ds))
            bad = next((i for i in range(len(ds)) if not _keeps_rule(self.row(i))), None)
        else:
            bad = _first_bad(self.table)
        if bad is not None:
            check_row(self.row(bad), where=self.where(bad))  # raises the row's own error
            raise DatasetError(f"{self.where(bad)}: breaks the row rule (`messages` or `prompt`)")

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> dict:
        return _present(self.ds[int(i)])

    def where(self, i: int) -> str:
        if self.jsonl is not None:  # the line, as the JSONL reader names it
            for n, (lineno, _) in enumerate(jsonl_lines(self.jsonl)):
                if n == i:
                    return f"{self.jsonl}:{lineno}"
        return f"{self.label} row {i}"

    def missing(self, field: str, start: int, stop: int) -> tuple[int, int] | None:
        if stop <= start:
            return None
        if field not in self.table.column_names:
            return start, stop - start
        column = self.table.column(field).slice(start, stop - start)
        if column.null_count == 0:
            return None
        at = 0
        for chunk in column.chunks:
            if chunk.null_count:
                return start + at + int(np.argmax(_mask(pc.is_null(chunk)))), column.null_count
            at += len(chunk)
        return None


def _present(value):
    """A row as its dict: nulls are columns the row did not have (see the module's docstring)."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value


def _keeps_rule(row: dict) -> bool:
    try:
        check_row(row, where="")
    except DatasetError:
        return False
    return True


def _directory(path: Path, cache: str | None) -> Rows:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise DatasetError(f"{path}: not a dataset saved by datasets: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DatasetError(f"{path}: holds splits {sorted(ds)}: name the split's directory")
        return ArrowRows(ds, str(path))
    files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and not p.name.startswith("."))
    if not files:
        raise DatasetError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
    parts = [(str(f), load_path(f, cache_dir=cache)) for f in files]
    return parts[0][1] if len(parts) == 1 else Concat(parts)


def _converted(path: Path, convert) -> datasets.Dataset:
    try:
        return convert()
    except Exception as e:
        cause = e.__cause__ or e
        raise DatasetError(
            f"{path}: cannot be read as {path.suffix[1:]}: {type(cause).__name__}: {cause}"
        ) from None


def _arrow_file(path: Path, cache: str | None) -> datasets.Dataset:
    """An Arrow stream file mapped where it lies, or an Arrow IPC file converted."""
    try:
        return datasets.Dataset.from_file(str(path))
    except (pa.ArrowInvalid, OSError):
        convert = functools.partial(
            datasets.load_dataset,
            "arrow",
            data_files=str(path),
            split="train",
            cache_dir=cache,
            writer_batch_size=WRITER_BATCH,
        )
        return _converted(path, convert)


def _jsonl(path: Path, cache: str | None) -> datasets.Dataset:
    """A JSONL file converted; a bad line is named as the JSONL reader names it."""
    try:
        ds = datasets.Dataset.from_json(str(path), cache_dir=cache, writer_batch_size=WRITER_BATCH)
    except Exception as e:
        read_jsonl(path)  # a line that is not a row, or no rows: its own error
        raise DatasetError(f"{path}: datasets cannot read it ({type(e).__name__}: {e})") from None
    floats = [
        name
        for name in ds.column_names
        if name not in ("prompt", "messages") and _has_float(ds.data.table.schema.field(name).type)
    ]
    if not floats:
        return ds
    features = ds.features.copy()
    for name in floats:  # read again with these columns as JSON: 4 stays 4 beside a 4.5
        features[name] = datasets.Json()
    return datasets.Dataset.from_json(
        str(path), cache_dir=cache, features=features, writer_batch_size=WRITER_BATCH
    )


def _has_float(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or any(_has_float(t.field(i).type) for i in range(t.num_fields))


# ---------------------------------------------------------------- the row rule, by column


def _first_bad(table: pa.Table) -> int | None:
    """The first row that breaks the row rule, or None (``prompt`` and ``messages`` are of
    :func:`_standard` types)."""
    names = [n for n in ("prompt", "messages") if n in table.column_names]
    if not names:
        return 0
    at = 0
    for batch in table.select(names).to_batches(max_chunksize=BATCH):
        bad = _bad_rows(batch)
        if bad.any():
            return at + int(np.argmax(bad))
        at += batch.num_rows
    return None


def _standard(schema: pa.Schema) -> bool:
    """Whether ``prompt`` is text and ``messages`` a list of ``{role, content}`` text structs:
    the types the column checks know."""
    if "prompt" in schema.names and not _is_text(schema.field("prompt").type):
        return False
    if "messages" not in schema.names or pa.types.is_null(t := schema.field("messages").type):
        return True
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
    return all(k in fields and _is_text(fields[k]) for k in ("role", "content"))


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _mask(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False).astype(bool)


def _valid(batch: pa.RecordBatch, name: str) -> np.ndarray:
    if name not in batch.schema.names:
        return np.zeros(batch.num_rows, bool)
    return _mask(pc.is_valid(batch.column(name)))


def _bad_rows(batch: pa.RecordBatch) -> np.ndarray:
    """Per row of ``batch``: whether it breaks the row rule (types already known standard)."""
    has_messages, has_prompt = _valid(batch, "messages"), _valid(batch, "prompt")
    bad = ~(has_messages | has_prompt)
    prompts = has_prompt & ~has_messages  # messages win when a row has both, as in check_row
    if prompts.any():
        bad |= prompts & _mask(pc.fill_null(pc.equal(pc.binary_length(batch.column("prompt")), 0), False))
    if has_messages.any():
        messages = batch.column("messages")
        empty = pc.fill_null(pc.equal(pc.list_value_length(messages), 0), False)
        bad |= has_messages & _mask(empty)
        items = pc.list_flatten(messages)
        broken = pc.or_(
            pc.is_null(items),
            pc.or_(pc.is_null(pc.struct_field(items, "role")), pc.is_null(pc.struct_field(items, "content"))),
        )
        parents = pc.list_parent_indices(messages).to_numpy()
        bad[parents[_mask(broken)]] = True
    return bad
