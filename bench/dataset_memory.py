"""Memory: a producer's rows memory-mapped through ``datasets`` vs read whole into memory.

A parquet file of N generated rows (``prompt`` of ~30 words, ``answer``, ``source``) and the
same rows as JSONL are written once. Each side then runs in a fresh process that imports
what a producer imports for its rows, records its memory, loads the rows as a producer does
(``load_rows`` + the reward's ``check_required`` + epoch 0's order) and reads ``--reads``
random rows by ticket:

- mapped:    the parquet through ``datasets`` (converted to Arrow once: the first process
             pays the conversion, reported apart; the measured one finds it in the cache);
- in_memory: the JSONL read by the plain reader (``datasets`` absent), a dict per row.

Reported per side, the growth over the process's memory before loading: RSS, its anonymous
part (the process's own memory) and its file-backed part (page cache pages of the mapped
Arrow that the process has touched: shared by every producer of the machine, and dropped by
the kernel under pressure), and the peak RSS; the file sizes; the load time. The ratio line
has the mapped side's anonymous growth over the parquet file's size, and over the in-memory
side's growth.

    python bench/dataset_memory.py                 # 2,000,000 rows (~150 MB parquet, minutes)
    python bench/dataset_memory.py --rows 500000
    python bench/dataset_memory.py --quick         # 50,000 rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i:x}" for i in range(4096)]  # a vocabulary: text that compresses like text


def write_files(directory: Path, n: int, *, seed: int = 0) -> tuple[Path, Path]:
    """``rows.parquet`` and ``rows.jsonl`` of ``n`` rows, written a chunk at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    parquet, jsonl = directory / "rows.parquet", directory / "rows.jsonl"
    writer = None
    with jsonl.open("w") as out:
        for start in range(0, n, 100_000):
            count = min(100_000, n - start)
            words = rng.integers(0, len(WORDS), size=(count, 30))
            prompts = [" ".join(WORDS[w] for w in row) + " =" for row in words]
            answers = [str(x) for x in rng.integers(0, 10_000, size=count)]
            table = pa.table({"prompt": prompts, "answer": answers, "source": ["bench"] * count})
            writer = writer or pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table)
            out.writelines(
                json.dumps({"prompt": p, "answer": a, "source": "bench"}) + "\n"
                for p, a in zip(prompts, answers)
            )
    writer.close()
    return parquet, jsonl


# One side, in a fresh process: prints one JSON line of figures.
SIDE = r"""
import json, random, sys, time

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}

path, cache, reads, plain = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "plain"
from producers import dataset
from producers.mix import order_of
if plain:
    dataset.has_datasets = lambda: False  # the reader of a machine without datasets
else:
    import datasets  # what the mapped side imports anyway: not the rows' memory
before = status()
started = time.perf_counter()
rows = dataset.load_rows(path, cache_dir=cache)
dataset.check_required(rows, ["answer"], source=path, reward="bench")
order = order_of(rows, seed=0)
order.position(0)
loaded = time.perf_counter() - started
at_load = status()
rng = random.Random(0)
started = time.perf_counter()
for ticket in rng.sample(range(len(rows)), reads):
    row = rows[order.position(ticket).row]
    assert row["answer"]
read = time.perf_counter() - started
after = status()
print(json.dumps({
    "rows": len(rows), "load_s": loaded, "read_us": read / reads * 1e6,
    **{f"{k}_load": at_load[k] - before[k] for k in ("VmRSS", "RssAnon", "RssFile")},
    **{f"{k}_reads": after[k] - before[k] for k in ("VmRSS", "RssAnon", "RssFile")},
    "peak": after["VmHWM"], "base": before["VmRSS"],
}))
"""


def side(path: Path, cache: Path, reads: int, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SIDE, str(path), str(cache), str(reads), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        sys.exit(f"{mode} side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--reads", type=int, default=10_000, help="random rows read after loading")
    ap.add_argument("--quick", action="store_true", help="50,000 rows, 2,000 reads")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.reads = 50_000, 2_000
    mb = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        parquet, jsonl = write_files(work, args.rows)
        print(
            f"{args.rows:,} rows: parquet {parquet.stat().st_size / mb:.0f} MB, jsonl {jsonl.stat().st_size / mb:.0f} MB "
            f"(written in {time.perf_counter() - started:.0f} s)"
        )
        cache = work / "cache"
        first = side(parquet, cache, args.reads, "mapped")  # converts
        print(
            f"first load (conversion to Arrow): {first['load_s']:.1f} s, peak RSS {first['peak'] / mb:.0f} MB, "
            f"anonymous memory kept {first['RssAnon_reads'] / mb:.0f} MB, Arrow cache {du(cache) / mb:.0f} MB"
        )
        mapped = side(parquet, cache, args.reads, "mapped")
        plain = side(jsonl, cache, args.reads, "plain")
        print(
            f"growth over the process before loading, MB (mapped side's RSS before: {mapped['base'] / mb:.0f} MB)"
        )
        print(
            f"{'side':<10} {'load s':>7} {'read us':>8} {'after':<13} {'RSS':>7} {'anon':>7} {'file':>7} {'peak':>7}"
        )
        for name, r in (("mapped", mapped), ("in_memory", plain)):
            for at, what in (("load", "loading"), ("reads", f"{args.reads} reads")):
                print(
                    f"{name:<10} {r['load_s']:>7.2f} {r['read_us']:>8.0f} {what:<13} {r[f'VmRSS_{at}'] / mb:>7.1f} "
                    f"{r[f'RssAnon_{at}'] / mb:>7.1f} {r[f'RssFile_{at}'] / mb:>7.1f} {r['peak'] / mb:>7.0f}"
                )
        size = parquet.stat().st_size
        anon = max(mapped["RssAnon_reads"], 1)
        print(
            f"ratios: anon_growth_vs_parquet={anon / size:.4f}x "
            f"rss_growth_at_load_vs_parquet={mapped['VmRSS_load'] / size:.4f}x "
            f"mapped_vs_in_memory={anon / max(plain['RssAnon_reads'], 1):.4f}x"
        )


if __name__ == "__main__":
    main()
