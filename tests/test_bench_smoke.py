"""Each benchmark of bench/ that has a --quick size runs at it, exits 0 and prints its ratio
line (the last line, or the one before a closing "bench took" line).

The benchmarks start their own private valkey-server, so this needs no fixture server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RATIO = re.compile(r"^ratios: (\S+=\d+\.\d\dx.*)$")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("transport.py", ["vs_raw_512", "vs_raw_4096", "vs_pipelinerl_512", "vs_pipelinerl_4096"]),
        ("codec.py", ["msgspec_vs_json_512", "msgspec_vs_pickle_lists_4096"]),
        ("memory.py", ["used_memory_per_payload_512", "max_xlen_vs_limit"]),
        ("metrics_memory.py", ["used_memory_1000_vs_200_steps"]),
        ("weight_sync.py", ["demo_1p", "demo_1p_path", "demo_1p_end"]),
        ("startup.py", ["archive_vs_torch_import", "up_vs_torch_import"]),
        ("producer_overhead.py", ["producer_vs_bare_per_group", "canned_producer_vs_bare_per_group"]),
        ("gpu_check.py", ["bf16_over_fp32_tokens_per_s"]),  # on CPU here: the checks' code runs
        ("packing.py", ["packed_vs_padded", "bucketed_vs_padded"]),
        ("judge.py", ["no_judge_vs_judge_c1", "no_judge_vs_judge_c4"]),
    ],
)
def test_bench_quick_prints_ratios(script, expected):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,  # a bound for a hung script, not a speed check: --quick takes seconds
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    last = lines[-2] if lines[-1].startswith("bench took") else lines[-1]
    match = RATIO.match(last)
    assert match, f"{script}: last line is not a ratio line: {last!r}"
    names = dict(part.split("=", 1) for part in re.findall(r"\S+=\S+", match.group(1)))
    for name in expected:
        assert name in names, f"{script}: no {name} in {last!r}"
        assert float(names[name].rstrip("x")) > 0, f"{script}: {name} is not positive in {last!r}"
