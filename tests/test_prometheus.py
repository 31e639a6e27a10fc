"""A real Prometheus scrapes the exporter during a short synthetic run; every dashboard
query must return data, and the alert rules must load and evaluate.

Needs the Debian ``prometheus`` package (``apt-get install -y prometheus``, as .ci/run
does); skipped with that reason when the binary is absent, a failure under ``CI=true``
(tests/needs.py). Installs nothing itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from needs import need_tool
from waits import Watch, wait_until

from schemas import DeadLetter, MetricsEvent, WeightSync
from schemas.metric_names import AXES
from streamer.bus import FIELD, Publisher
from streamer.config import RunConfig
from streamer.server import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ops"))
import dashboards  # noqa: E402

APT = "apt-get install -y prometheus"


@pytest.fixture
def prometheus() -> str:
    return need_tool("prometheus", APT)


@pytest.fixture
def promtool() -> str:
    return need_tool("promtool", APT)  # ships in the same Debian package


SUBSTITUTE = {"$job": ".+", "$__rate_interval": "30s"}  # what Grafana would fill in


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def until(what: str, fn, procs: list[subprocess.Popen]):
    """``fn`` truthy within 30 s (a server not answering yet counts as not yet)."""
    ignore = (urllib.error.URLError, ConnectionError)
    return wait_until(fn, timeout=30.0, what=what, watch=Watch(*procs), interval=0.2, ignore=ignore)


def round_of_events(pub: Publisher, keys, client, i: int) -> None:
    """One step of a synthetic run: every catalog name on every axis, two producers."""

    def values(axis: str) -> dict[str, float]:
        return {
            name: float(i + 1) if kind == "counter" else 0.1 * (i + 1)
            for name, (kind, _) in AXES[axis].items()
        }

    events = [MetricsEvent(axis="train", step=i + 1, values=values("train"), source="trainer")]
    events += [
        MetricsEvent(axis="rollout", step=2 * i + k, values=values("rollout"), source=f"producer-p{k}")
        for k in (1, 2)
    ]
    events.append(MetricsEvent(axis="eval", step=i + 1, values=values("eval"), source="eval"))
    pub.publish_many(keys.metrics, events)
    pub.publish(keys.policy, WeightSync(version=i + 1, step=i + 1, uri="file:///w", sha256="0" * 64))
    client.xadd(keys.traj, {FIELD: b"group"})
    client.xreadgroup("trainer", "t", {keys.traj: ">"}, count=1)
    client.zadd(keys.producers, {"p1": time.time(), "p2": time.time()})
    if i == 2:
        pub.publish(keys.dead, DeadLetter(stream=keys.traj, entry_id=f"{i}-0", raw=b"x", reason="malformed"))


def prometheus_config(tmp_path: Path, exporter_port: int) -> Path:
    cfg = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ROOT / "ops" / "prometheus" / "alerts.yml")]
    cfg["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{exporter_port}"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_promtool_accepts_ops_files(promtool):
    ops = ROOT / "ops" / "prometheus"
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ):
        res = subprocess.run([promtool, *args], cwd=ops, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"promtool {' '.join(args)}:\n{res.stdout}{res.stderr}"


@pytest.mark.slow
def test_every_dashboard_query_returns_data(prometheus, redis_url, keys, client, tmp_path):
    pub = Publisher(client, keys, RunConfig().bus)
    client.xgroup_create(keys.traj, "trainer", id="0", mkstream=True)
    pub.publish(keys.dead, DeadLetter(stream=keys.traj, entry_id="1-0", raw=b"x", reason="malformed msgpack"))
    client.set(keys.admitted, 3)
    client.hset(keys.limits, mapping={"max_staleness": 1, "groups_per_step": 2})
    round_of_events(pub, keys, client, 0)

    exporter_port, prom_port = free_port(), free_port()
    run_toml = tmp_path / "run.toml"
    run_toml.write_text("[metrics]\nhealth_interval = 0.5\n")
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamer",
            "metrics",
            "--config",
            str(run_toml),
            "--redis-url",
            redis_url,
            "--run",
            keys.run,
            "--port",
            str(exporter_port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={prometheus_config(tmp_path, exporter_port)}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    procs = [exporter, prom]
    try:

        def query(expr: str) -> list:
            return get_json(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]

        def scraped(n: int):
            res = query("count_over_time(up[1m])")
            return res and float(res[0]["value"][1]) >= n and query("up")[0]["value"][1] == "1"

        until("the first scrape of the exporter", lambda: scraped(1), procs)
        for i in range(1, 4):  # a short run: new events between scrapes
            round_of_events(pub, keys, client, i)
            until(f"scrape {i + 1}", lambda i=i: scraped(i + 1), procs)
        until("the last events to be scraped", lambda: query("streamer_train_step == 4"), procs)

        empty = []
        for title, expr in dashboards.queries(dashboards.render()):
            for k, v in SUBSTITUTE.items():
                expr = expr.replace(k, v)
            if not query(expr):
                empty.append(f"{title}: {expr}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

        def rules_evaluated():
            """Every rule evaluated, the last time after the dead letter was scraped."""
            rules = [r for g in get_json(f"{api}/rules")["data"]["groups"] for r in g["rules"]]
            dead = [r for r in rules if r["name"] == "StreamerDeadLetters" and r["state"] != "inactive"]
            return rules if dead and all(r["health"] == "ok" for r in rules) else None

        rules = until("every alert rule to evaluate, StreamerDeadLetters active", rules_evaluated, procs)
        assert {r["name"] for r in rules} == {
            "StreamerTrainerStalled",
            "StreamerTrajectoryLagGrowing",
            "StreamerDeadLetters",
            "StreamerNoLiveProducers",
            "StreamerExporterDown",
        }
        firing = {r["name"] for r in rules if r["state"] != "inactive"}
        assert "StreamerDeadLetters" in firing  # one dead letter appeared during the run
        assert "StreamerTrainerStalled" not in firing and "StreamerNoLiveProducers" not in firing
    finally:
        exporter.send_signal(signal.SIGTERM)
        prom.terminate()
        exporter_rc = exporter.wait(timeout=15)
        prom.wait(timeout=15)
    assert exporter_rc == 0
