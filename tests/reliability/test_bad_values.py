"""Values an operator or a bug leaves in the server (item 8): each role that reads one exits
with one line naming the key, never a traceback."""

from __future__ import annotations

import pytest
from harness import report, run_config

from streamer.connection import connect
from streamer.keys import Keys

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "key, value, role",
    [
        ("version", "not-a-number", "train"),
        ("limits", "a string, not a hash", "status"),
        ("admitted", "many", "produce"),
        ("rollout_step", "many", "produce"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(private_valkey, procs, tmp_path, key, value, role):
    url, keys = private_valkey.url, Keys("bad")
    client = connect(url)
    client.set(getattr(keys, key), value)
    config = run_config(tmp_path / "run.toml", keys, tmp_path / "data", producer={"max_groups": 1})
    procs.start(role, role, "--config", str(config), "--redis-url", url)
    code = procs.wait(role, 180)
    log = procs.log(role)
    report("bad-value", key=key, role=role, exit=code)
    assert code == 1, log
    assert "Traceback" not in log and getattr(keys, key) in log, log[-3000:]
