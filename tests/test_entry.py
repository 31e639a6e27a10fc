"""`python -m streamer` imports a command's code with the cyclic garbage collector off, then
freezes what was imported out of its reach and runs the command with the collector on;
`streamer.cli.main` called in a process of its own choosing (a test's) leaves its collector
alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bounds import START

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import gc, json, sys, types
from streamer import __main__ as entry, cli

seen = {}
def probe(cfg, args):
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    return 0

sys.modules["probe_role"] = types.SimpleNamespace(main=probe)
cli.ROLES["status"] = "probe_role:main"
if sys.argv[1] == "entry":
    sys.argv = ["streamer", "status"]
    code = entry.run()
else:
    code = cli.main(["status"])
print(json.dumps({**seen, "code": code, "after": gc.isenabled()}))
"""


def _probe(how: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, how], cwd=ROOT, capture_output=True, text=True, timeout=START
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_entry_point_runs_the_command_with_its_imports_frozen_and_the_collector_on():
    seen = _probe("entry")
    assert seen["code"] == 0
    assert seen["enabled"] and seen["after"], "the command ran with the garbage collector off"
    assert seen["frozen"] > 10_000, f"only {seen['frozen']} objects frozen: the imports were not"


def test_main_called_by_another_program_leaves_its_collector_alone():
    seen = _probe("main")
    assert seen["code"] == 0
    assert seen["enabled"] and seen["frozen"] == 0
