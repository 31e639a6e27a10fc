"""The generated Grafana dashboard, its --check, and the provisioning files."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from consumers.exporter import SERIES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ops"))
import dashboards  # noqa: E402  (ops/ is scripts, not a package)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "ops/dashboards.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_committed_dashboard_is_current_and_valid():
    res = run_script("--check")
    assert res.returncode == 0, res.stderr
    assert "is current" in res.stdout
    committed = json.loads(dashboards.OUTPUT.read_text())
    assert committed == dashboards.render()
    assert dashboards.check(committed, SERIES) == []


def test_check_fails_on_unknown_series(tmp_path):
    board = copy.deepcopy(dashboards.render())
    (panel,) = [p for p in board["panels"] if p["title"] == "Rollout reward (5m)"]
    target = panel["targets"][0]
    target["expr"] = target["expr"].replace("streamer_rollout_reward_mean", "streamer_rollout_reward_avg")
    errors = dashboards.check(board, SERIES)
    assert len(errors) == 1 and "unknown series streamer_rollout_reward_avg" in errors[0], errors

    out = tmp_path / "streamer.json"
    out.write_text(dashboards.dumps(board))
    res = run_script("--check", "--output", str(out))
    assert res.returncode == 1
    assert "is stale" in res.stderr and "streamer_rollout_reward_avg" in res.stderr, res.stderr


def test_check_fails_on_unknown_label_and_missing_file(tmp_path):
    board = {
        "panels": [
            {
                "title": "x",
                "targets": [
                    {"expr": 'sum by (reason) (streamer_train_loss{job=~"$job"})'},
                    {"expr": "vector(1)"},
                ],
            }
        ]
    }
    errors = dashboards.check(board, SERIES)
    assert any("label(s) reason" in e for e in errors), errors
    assert any("queries no streamer_ series" in e for e in errors), errors
    res = run_script("--check", "--output", str(tmp_path / "missing.json"))
    assert res.returncode == 1 and "run python ops/dashboards.py" in res.stderr


def test_rows_and_required_panels():
    board = dashboards.render()
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Training", "Rollout", "Episodes (multi-turn rollouts)", "Eval", "Pipeline"]
    exprs = " ".join(e for _, e in dashboards.queries(board))
    required = [
        "train_loss",
        "train_kl",
        "train_entropy",
        "train_clip_fraction",
        "train_grad_norm",
        "train_lr",
        "rollout_reward_mean",
        "rollout_response_length_mean",
        "rollout_truncated_ratio",
        "rollout_admission_wait_seconds",
        "eval_accuracy",
        "eval_pass_at_k",
        "eval_mean_at_k",
        "stream_group_lag",
        "stream_group_pending",
        "dead_letters_total",
        "train_weight_sync_seconds",
        "policy_version",
        "train_seconds_since_last_step",
        "stream_entries_added_total",
        "rollout_turns_mean",
        "rollout_tool_calls_total",
        "rollout_proxy_divergences_total",
        "rollout_prefix_mismatches_total",
        "rollout_episode_seconds",
        "rollout_in_flight_episodes",
        "rollout_episodes_dropped_timeout_total",
    ]
    for name in required:
        assert f"streamer_{name}" in exprs, name
    assert "sum by (producer)" in exprs  # throughput per producer
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:  # nothing overflows the 24-column grid
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_series_follow_prometheus_naming():
    for name, s in SERIES.items():
        assert re.fullmatch(r"streamer_[a-z0-9_]+", name), name
        assert name.endswith("_total") == (s.kind == "counter"), name
        assert "id" not in s.labels and len(s.labels) <= 2, name
    for axis in ("train", "rollout", "eval"):
        assert SERIES[f"streamer_{axis}_step"].kind == "gauge"


def test_grafana_provisioning_files():
    prov = ROOT / "ops" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "streamer.yaml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    prov_dash = yaml.safe_load((prov / "dashboards" / "streamer.yaml").read_text())
    (provider,) = prov_dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    prom = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
