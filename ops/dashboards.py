"""Generate the Grafana dashboard from the description below; ``--check`` keeps it honest.

    python ops/dashboards.py            # rewrite ops/grafana/dashboards/streamer.json
    python ops/dashboards.py --check    # exit 1 if the JSON is stale or a panel queries a
                                        # series (or label) the exporter does not define

The series the exporter defines come from ``consumers.exporter.SERIES``, so a renamed
metric breaks the check instead of leaving a silent empty panel. Every selector carries
``job=~"$job"`` (a dashboard variable), so one Prometheus can scrape several runs'
exporters under different jobs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))
from schemas.metric_names import EPISODE_DROP_REASONS  # noqa: E402

OUTPUT = ROOT / "ops" / "grafana" / "dashboards" / "streamer.json"
UID = "streamer-run"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PROMETHEUS_LABELS = {"job", "instance"}  # added by the scrape, present on every series
RATE = "$__rate_interval"


def m(name: str, **labels: str) -> str:
    """A selector of one series, scoped to the dashboard's job variable."""
    sel = ['job=~"$job"'] + [f'{k}="{v}"' for k, v in labels.items()]
    return f"{name}{{{','.join(sel)}}}"


class Panel(NamedTuple):
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 8


def ts(title: str, *targets: tuple[str, str], unit: str = "short", width: int = 8) -> Panel:
    return Panel(title, targets, unit, "timeseries", width)


def stat(title: str, expr: str, unit: str = "short") -> Panel:
    return Panel(title, ((expr, title),), unit, "stat", 3)


def rate(name: str, by: str = "", **labels: str) -> str:
    inner = f"rate({m(name, **labels)}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


TRAIN = "streamer_train_"
ROLL = "streamer_rollout_"

ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Overview",
        [
            stat("Rollout reward (5m)", f"avg(avg_over_time({m(ROLL + 'reward_mean')}[5m]))"),
            Panel(
                "Eval accuracy",
                ((f"max by (set) ({m('streamer_eval_accuracy')})", "{{set}}"),),
                "percentunit",
                "stat",
                3,
            ),
            stat("Rollout tokens/s", rate(ROLL + "tokens_total")),
            stat("Policy version", f"max({m('streamer_policy_version')})"),
            stat("Staleness (versions)", f"max({m(TRAIN + 'staleness_mean')})"),
            stat(
                "Trajectory lag",
                f"sum({m('streamer_stream_group_lag', stream='traj', group='trainer')})",
            ),
            stat("Since last step", f"max({m('streamer_train_seconds_since_last_step')})", "s"),
            stat("Live producers", f"sum({m('streamer_live_producers')})"),
        ],
    ),
    (
        "Training",
        [
            ts("Loss", (m(TRAIN + "loss"), "loss"), (m(TRAIN + "policy_loss"), "policy loss")),
            ts("KL to reference", (m(TRAIN + "kl"), "kl")),
            ts("Entropy", (m(TRAIN + "entropy"), "entropy")),
            ts(
                "Clip fraction",
                (m(TRAIN + "clip_fraction"), "clipped"),
                (m(TRAIN + "clip_low_fraction"), "low side (A < 0)"),
                (m(TRAIN + "clip_high_fraction"), "high side (A > 0)"),
                unit="percentunit",
            ),
            ts(
                "Trainer vs sampler mismatch (KL)",
                (m(TRAIN + "mismatch_kl"), "KL(sampler || trainer)"),
            ),
            ts(
                "PPO KL and ratio",
                (m(TRAIN + "ppo_kl"), "KL(proximal || current)"),
                (m(TRAIN + "ratio_mean"), "ratio mean"),
            ),
            ts(
                "Trained response length (tokens)",
                (m(TRAIN + "response_length_mean"), "mean"),
                (m(TRAIN + "response_length_max"), "max"),
            ),
            ts(
                "Step phases",
                (m(TRAIN + "proximal_forward_seconds"), "proximal forward"),
                (m(TRAIN + "reference_forward_seconds"), "reference forward"),
                (m(TRAIN + "forward_backward_seconds"), "forward-backward"),
                (m(TRAIN + "optimizer_seconds"), "optimizer"),
                unit="s",
            ),
            ts("Grad norm", (m(TRAIN + "grad_norm"), "grad norm")),
            ts("Learning rate", (m(TRAIN + "lr"), "lr")),
            ts(
                "Importance weights",
                (m(TRAIN + "is_weight_mean"), "mean"),
                (m(TRAIN + "is_weight_max"), "max"),
            ),
            ts("Trained tokens/s", (m(TRAIN + "tokens_per_second"), "tokens/s")),
            ts(
                "Step time",
                (m(TRAIN + "step_seconds"), "step"),
                (m(TRAIN + "data_wait_seconds"), "data wait"),
                unit="s",
            ),
            ts(
                "Groups accepted / rejected per second",
                (rate(TRAIN + "groups_accepted_total"), "accepted"),
                (rate(TRAIN + "groups_rejected_stale_total"), "stale"),
                (rate(TRAIN + "groups_rejected_zero_variance_total"), "zero variance"),
                (rate(TRAIN + "groups_rejected_too_few_samples_total"), "too few samples"),
                (rate(TRAIN + "groups_rejected_overlong_total"), "overlong"),
                (rate(TRAIN + "groups_rejected_user_filter_total"), "user filter"),
                (rate(TRAIN + "groups_rejected_too_long_total"), "too long"),
                (rate(TRAIN + "optimizer_steps_skipped_total"), "optimizer steps skipped"),
            ),
            ts(
                "Staleness (versions)",
                (m(TRAIN + "staleness_mean"), "mean"),
                (m(TRAIN + "staleness_max"), "max"),
            ),
            ts(
                "Train step",
                (m(TRAIN + "step"), "step"),
                (m(TRAIN + "reward_mean"), "reward of trained groups"),
            ),
        ],
    ),
    (
        "Rollout",
        [
            ts(
                "Reward",
                (f"avg(avg_over_time({m(ROLL + 'reward_mean')}[1m]))", "reward (1m mean)"),
                (f"avg(avg_over_time({m(ROLL + 'accuracy')}[1m]))", "accuracy (1m mean)"),
            ),
            ts(
                "Response length (tokens)",
                (m(ROLL + "response_length_mean"), "mean"),
                (m(ROLL + "response_length_min"), "min"),
                (m(ROLL + "response_length_max"), "max"),
            ),
            ts(
                "Truncated",
                (f"avg(avg_over_time({m(ROLL + 'truncated_ratio')}[1m]))", "truncated"),
                unit="percentunit",
            ),
            ts("Tokens/s per producer", (rate(ROLL + "tokens_total", "producer"), "{{producer}}")),
            ts("Groups/s per producer", (rate(ROLL + "groups_total", "producer"), "{{producer}}")),
            ts(
                "Admission and backpressure wait",
                (m(ROLL + "admission_wait_seconds"), "admission"),
                (m(ROLL + "backpressure_wait_seconds"), "backpressure"),
                (m(ROLL + "sample_seconds"), "sampling"),
                unit="s",
            ),
            ts("Version offset", (m(ROLL + "version_offset"), "versions behind")),
            ts(
                "Rows (solved and unsolvable rows are set aside)",
                (f"max({m(ROLL + 'rows_active')})", "active"),
                (f"max({m(ROLL + 'rows_solved')})", "solved"),
                (f"max({m(ROLL + 'rows_unsolvable')})", "unsolvable"),
                (rate(ROLL + "rows_passed_over_total"), "passed over (/s)"),
            ),
            ts(
                "Failures per second",
                (rate(ROLL + "sample_failures_total"), "sample failures"),
                (rate(ROLL + "groups_dropped_total"), "groups dropped"),
                (rate(ROLL + "weight_load_errors_total"), "weight load errors"),
            ),
            ts("Rollout step", (m(ROLL + "step"), "step")),
        ],
    ),
    (
        "Episodes (multi-turn rollouts)",
        [
            ts("Turns per episode", (m(ROLL + "turns_mean"), "turns (group mean)")),
            ts("Tool calls/s", (rate(ROLL + "tool_calls_total"), "tool calls")),
            ts("Episode seconds", (m(ROLL + "episode_seconds"), "rollout of a group"), unit="s"),
            ts("Rows in flight", (m(ROLL + "in_flight_episodes"), "in flight")),
            ts(
                "Episodes dropped per second",
                (rate(ROLL + "prefix_mismatches_total"), "prefix mismatches"),
                (rate(ROLL + "proxy_divergences_total"), "proxy divergences (a new chain, not dropped)"),
                (rate(ROLL + "episode_forks_total"), "forks (extra samples, not dropped)"),
                *(
                    (rate(ROLL + f"episodes_dropped_{r}_total"), r.replace("_", " "))
                    for r in EPISODE_DROP_REASONS
                ),
                width=16,
            ),
        ],
    ),
    (
        "Eval",
        [
            ts(
                "Eval accuracy (mean@k) per set",
                (m("streamer_eval_mean_at_k"), "{{set}}"),
                unit="percentunit",
            ),
            ts("Eval pass@k per set", (m("streamer_eval_pass_at_k"), "{{set}}"), unit="percentunit"),
            ts("Eval reward per set", (m("streamer_eval_reward_mean"), "{{set}}")),
            ts("Eval response length per set", (m("streamer_eval_response_length_mean"), "{{set}}")),
            ts(
                "Evaluated version, rows and k",
                (m("streamer_eval_step"), "version"),
                (m("streamer_eval_rows"), "{{set}} rows"),
                (m("streamer_eval_k"), "{{set}} k"),
            ),
            ts("Eval time per set", (m("streamer_eval_eval_seconds"), "{{set}}"), unit="s"),
        ],
    ),
    (
        "Pipeline",
        [
            ts(
                "Trajectories published vs consumed (/s)",
                (rate("streamer_stream_entries_added_total", stream="traj"), "published"),
                (
                    rate("streamer_stream_group_entries_read_total", stream="traj", group="trainer"),
                    "consumed",
                ),
            ),
            ts(
                "Consumer-group lag",
                (f"sum by (stream, group) ({m('streamer_stream_group_lag')})", "{{stream}}/{{group}}"),
            ),
            ts(
                "Pending (unacknowledged)",
                (
                    f"sum by (stream, group) ({m('streamer_stream_group_pending')})",
                    "{{stream}}/{{group}}",
                ),
            ),
            ts("Stream length", (f"sum by (stream) ({m('streamer_stream_length')})", "{{stream}}")),
            ts(
                "Dead letters (10m)",
                (f"sum(increase({m('streamer_dead_letters_total')}[10m]))", "dead letters"),
            ),
            ts(
                "Weight sync latency",
                (m(TRAIN + "weight_sync_seconds"), "trainer write + publish"),
                (m(ROLL + "weight_load_seconds"), "producer load"),
                unit="s",
            ),
            ts(
                "Policy age",
                (m("streamer_policy_age_seconds"), "since newest version"),
                (m("streamer_train_seconds_since_last_step"), "since last train step"),
                unit="s",
            ),
            ts(
                "Admission",
                (m("streamer_admitted_groups"), "admitted"),
                (m("streamer_admission_limit_groups"), "limit"),
            ),
            ts("Live producers", (m("streamer_live_producers"), "live")),
        ],
    ),
]


# ---------------------------------------------------------------- rendering


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    height = 4 if p.kind == "stat" else 8
    out = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "targets": [
            {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(p.targets)
        ],
    }
    if p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return out


def _variables() -> list[dict]:
    job = {
        "name": "job",
        "label": "Job",
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": "label_values(streamer_exporter_events_total, job)", "refId": "job"},
        "definition": "label_values(streamer_exporter_events_total, job)",
        "includeAll": True,
        "multi": True,
        "allValue": ".+",
        "refresh": 2,
        "current": {"selected": True, "text": "All", "value": "$__all"},
    }
    source = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"}
    return [source, job]


def render() -> dict:
    """The dashboard JSON (deterministic: same description, same bytes)."""
    panels, pid, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, panels[-1]["gridPos"]["h"])
        y += row_h
    return {
        "uid": UID,
        "title": "Streamer run",
        "description": "Generated by ops/dashboards.py from consumers.exporter.SERIES; do not edit by hand.",
        "tags": ["streamer", "rl"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "panels": panels,
    }


def dumps(dashboard: dict) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


# ---------------------------------------------------------------- checking


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, in panel order."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


_SERIES_RE = re.compile(r"\b(streamer_[a-z0-9_]+)\b")
_BY_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR_RE = re.compile(r"\{([^}]*)\}")
_MATCHER_RE = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")


def check(dashboard: dict, series: Mapping) -> list[str]:
    """Errors: queries naming series, or labels, that the exporter does not define."""
    errors = []
    for title, expr in queries(dashboard):
        names = _SERIES_RE.findall(expr)
        if not names:
            errors.append(f"panel {title!r}: {expr!r} queries no streamer_ series")
        unknown = sorted({n for n in names if n not in series})
        if unknown:
            errors.append(
                f"panel {title!r}: unknown series {', '.join(unknown)} (not in consumers.exporter.SERIES)"
            )
        labels = set(PROMETHEUS_LABELS)
        for n in names:
            if n in series:
                labels |= set(series[n].labels)
        used = {lb.strip() for group in _BY_RE.findall(expr) for lb in group.split(",") if lb.strip()}
        used |= {lb for sel in _SELECTOR_RE.findall(expr) for lb in _MATCHER_RE.findall(sel)}
        if bad := sorted(used - labels):
            errors.append(f"panel {title!r}: label(s) {', '.join(bad)} not on the queried series")
    return errors


def exporter_series() -> Mapping:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from consumers.exporter import SERIES

    return SERIES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify instead of writing")
    ap.add_argument("--output", type=Path, default=OUTPUT, help="dashboard JSON path")
    args = ap.parse_args(argv)
    dashboard = render()
    errors = check(dashboard, exporter_series())
    if not args.check:
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(dumps(dashboard))
        print(f"wrote {args.output} ({len(queries(dashboard))} queries)")
        return 0
    try:
        committed = args.output.read_text()
    except OSError as e:
        errors.append(f"{args.output}: {e.strerror}; run python ops/dashboards.py")
    else:
        if committed != dumps(dashboard):
            errors.append(f"{args.output} is stale: run python ops/dashboards.py and commit it")
        errors += [f"{args.output}: {e}" for e in check(json.loads(committed), exporter_series())]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    print(f"ok: {args.output} is current; {len(queries(dashboard))} queries use only exporter series")
    return 0


if __name__ == "__main__":
    sys.exit(main())
