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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))
from schemas.metric_names import EPISODE_DROP_REASONS, REJECT_REASONS  # noqa: E402

OUTPUT = ROOT / "ops" / "grafana" / "dashboards" / "streamer.json"
UID = "streamer-run"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PROMETHEUS_LABELS = {"job", "instance"}  # added by the scrape, present on every series
RATE = "$__rate_interval"


# A panel is its targets, or (targets, Grafana unit); targets are {legend: PromQL}, or one
# PromQL expression whose legend is the panel's title. render() narrows every streamer_
# selector to the $job variable; a panel of more than 8 series is twice as wide.
PanelSpec = str | Mapping[str, str] | tuple[str | Mapping[str, str], str]


def rate(selector: str, by: str = "") -> str:
    inner = f"rate({selector}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def per_group(series: str) -> dict[str, str]:
    """One line per consumer group of a stream."""
    return {"{{stream}}/{{group}}": f"sum by (stream, group) ({series})"}


OVERVIEW: dict[str, PanelSpec] = {  # stat panels: the latest value
    "Rollout reward (5m)": "avg(avg_over_time(streamer_rollout_reward_mean[5m]))",
    "Eval accuracy": ({"{{set}}": "max by (set) (streamer_eval_accuracy)"}, "percentunit"),
    "Rollout tokens/s": rate("streamer_rollout_tokens_total"),
    "Policy version": "max(streamer_policy_version)",
    "Staleness (versions)": "max(streamer_train_staleness_mean)",
    "Trajectory lag": 'sum(streamer_stream_group_lag{stream="traj",group="trainer"})',
    "Since last step": ("max(streamer_train_seconds_since_last_step)", "s"),
    "Live producers": "sum(streamer_live_producers)",
}

ROWS: dict[str, dict[str, PanelSpec]] = {  # time series
    "Training": {
        "Loss": {"loss": "streamer_train_loss", "policy loss": "streamer_train_policy_loss"},
        "KL to reference": {"kl": "streamer_train_kl"},
        "Entropy": {"entropy": "streamer_train_entropy"},
        "Clip fraction": (
            {
                "clipped": "streamer_train_clip_fraction",
                "low side (A < 0)": "streamer_train_clip_low_fraction",
                "high side (A > 0)": "streamer_train_clip_high_fraction",
            },
            "percentunit",
        ),
        "Trainer vs sampler mismatch (KL)": {"KL(sampler || trainer)": "streamer_train_mismatch_kl"},
        "PPO KL and ratio": {
            "KL(proximal || current)": "streamer_train_ppo_kl",
            "ratio mean": "streamer_train_ratio_mean",
        },
        "Trained response length (tokens)": {
            "mean": "streamer_train_response_length_mean",
            "max": "streamer_train_response_length_max",
        },
        "Step phases": (
            {
                "proximal forward": "streamer_train_proximal_forward_seconds",
                "reference forward": "streamer_train_reference_forward_seconds",
                "forward-backward": "streamer_train_forward_backward_seconds",
                "optimizer": "streamer_train_optimizer_seconds",
            },
            "s",
        ),
        "Grad norm": {"grad norm": "streamer_train_grad_norm"},
        "Learning rate": {"lr": "streamer_train_lr"},
        "Importance weights": {
            "mean": "streamer_train_is_weight_mean",
            "max": "streamer_train_is_weight_max",
        },
        "Trained tokens/s": {"tokens/s": "streamer_train_tokens_per_second"},
        "Step time": (
            {"step": "streamer_train_step_seconds", "data wait": "streamer_train_data_wait_seconds"},
            "s",
        ),
        "Groups accepted / rejected per second": {
            "accepted": rate("streamer_train_groups_accepted_total"),
            **{
                r.replace("_", " "): rate(f"streamer_train_groups_rejected_{r}_total") for r in REJECT_REASONS
            },
            "optimizer steps skipped": rate("streamer_train_optimizer_steps_skipped_total"),
            "groups of skipped steps": rate("streamer_train_groups_skipped_total"),
        },
        "Staleness (versions)": {
            "mean": "streamer_train_staleness_mean",
            "max": "streamer_train_staleness_max",
        },
        "Train step": {
            "step": "streamer_train_step",
            "reward of trained groups": "streamer_train_reward_mean",
        },
    },
    "Rollout": {
        "Reward": {
            "reward (1m mean)": "avg(avg_over_time(streamer_rollout_reward_mean[1m]))",
            "accuracy (1m mean)": "avg(avg_over_time(streamer_rollout_accuracy[1m]))",
        },
        "Response length (tokens)": {
            "mean": "streamer_rollout_response_length_mean",
            "min": "streamer_rollout_response_length_min",
            "max": "streamer_rollout_response_length_max",
        },
        "Truncated": (
            {"truncated": "avg(avg_over_time(streamer_rollout_truncated_ratio[1m]))"},
            "percentunit",
        ),
        "Tokens/s per producer": {"{{producer}}": rate("streamer_rollout_tokens_total", "producer")},
        "Groups/s per producer": {"{{producer}}": rate("streamer_rollout_groups_total", "producer")},
        "Admission and backpressure wait": (
            {
                "admission": "streamer_rollout_admission_wait_seconds",
                "backpressure": "streamer_rollout_backpressure_wait_seconds",
                "sampling": "streamer_rollout_sample_seconds",
            },
            "s",
        ),
        "Version offset": {"versions behind": "streamer_rollout_version_offset"},
        "Rows (solved and unsolvable rows are set aside)": {
            "active": "max(streamer_rollout_rows_active)",
            "solved": "max(streamer_rollout_rows_solved)",
            "unsolvable": "max(streamer_rollout_rows_unsolvable)",
            "passed over (/s)": rate("streamer_rollout_rows_passed_over_total"),
        },
        "Failures per second": {
            "sample failures": rate("streamer_rollout_sample_failures_total"),
            "groups dropped": rate("streamer_rollout_groups_dropped_total"),
            "weight load errors": rate("streamer_rollout_weight_load_errors_total"),
        },
        "Rollout step": {"step": "streamer_rollout_step"},
    },
    "Episodes (multi-turn rollouts)": {
        "Turns per episode": {"turns (group mean)": "streamer_rollout_turns_mean"},
        "Tool calls/s": {"tool calls": rate("streamer_rollout_tool_calls_total")},
        "Episode seconds": ({"rollout of a group": "streamer_rollout_episode_seconds"}, "s"),
        "Rows in flight": {"in flight": "streamer_rollout_in_flight_episodes"},
        "Episodes dropped per second": {
            "prefix mismatches": rate("streamer_rollout_prefix_mismatches_total"),
            "proxy divergences (a new chain, not dropped)": rate("streamer_rollout_proxy_divergences_total"),
            "forks (extra samples, not dropped)": rate("streamer_rollout_episode_forks_total"),
            **{
                r.replace("_", " "): rate(f"streamer_rollout_episodes_dropped_{r}_total")
                for r in EPISODE_DROP_REASONS
            },
        },
    },
    "Eval": {
        "Eval accuracy (mean@k) per set": ({"{{set}}": "streamer_eval_mean_at_k"}, "percentunit"),
        "Eval pass@k per set": ({"{{set}}": "streamer_eval_pass_at_k"}, "percentunit"),
        "Eval reward per set": {"{{set}}": "streamer_eval_reward_mean"},
        "Eval response length per set": {"{{set}}": "streamer_eval_response_length_mean"},
        "Evaluated version, rows and k": {
            "version": "streamer_eval_step",
            "{{set}} rows": "streamer_eval_rows",
            "{{set}} k": "streamer_eval_k",
        },
        "Eval time per set": ({"{{set}}": "streamer_eval_eval_seconds"}, "s"),
    },
    "Pipeline": {
        "Trajectories published vs consumed (/s)": {
            "published": rate('streamer_stream_entries_added_total{stream="traj"}'),
            "consumed": rate('streamer_stream_group_entries_read_total{stream="traj",group="trainer"}'),
        },
        "Consumer-group lag": per_group("streamer_stream_group_lag"),
        "Pending (unacknowledged)": per_group("streamer_stream_group_pending"),
        "Stream length": {"{{stream}}": "sum by (stream) (streamer_stream_length)"},
        "Dead letters (10m)": {"dead letters": "sum(increase(streamer_dead_letters_total[10m]))"},
        "Weight sync latency": (
            {
                "trainer write + publish": "streamer_train_weight_sync_seconds",
                "producer load": "streamer_rollout_weight_load_seconds",
            },
            "s",
        ),
        "Policy age": (
            {
                "since newest version": "streamer_policy_age_seconds",
                "since last train step": "streamer_train_seconds_since_last_step",
            },
            "s",
        ),
        "Admission": {"admitted": "streamer_admitted_groups", "limit": "streamer_admission_limit_groups"},
        "Live producers": {"live": "streamer_live_producers"},
    },
}


# ---------------------------------------------------------------- rendering

_SELECTOR = re.compile(r"\b(streamer_[a-z0-9_]+)(?:\{([^}]*)\})?")


def scoped(expr: str) -> str:
    """``expr`` with every streamer_ selector narrowed to the dashboard's job variable."""

    def narrow(sel: re.Match) -> str:
        matchers = ['job=~"$job"'] + ([sel[2]] if sel[2] else [])
        return f"{sel[1]}{{{','.join(matchers)}}}"

    return _SELECTOR.sub(narrow, expr)


def _panel(title: str, spec: PanelSpec, kind: str) -> dict:
    """One panel of ``kind``; render() numbers and places it."""
    targets, unit = spec if isinstance(spec, tuple) else (spec, "short")
    if isinstance(targets, str):
        targets = {title: targets}
    width = 3 if kind == "stat" else 16 if len(targets) > 8 else 8
    out = {
        "id": 0,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 4 if kind == "stat" else 8, "w": width, "x": 0, "y": 0},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "datasource": DATASOURCE,
                "expr": scoped(expr),
                "legendFormat": legend,
                "refId": chr(ord("A") + i),
            }
            for i, (legend, expr) in enumerate(targets.items())
        ],
    }
    if kind == "stat":
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
    rows = [("Overview", [_panel(t, spec, "stat") for t, spec in OVERVIEW.items()])]
    rows += [
        (row, [_panel(t, spec, "timeseries") for t, spec in specs.items()]) for row, specs in ROWS.items()
    ]
    panels, y = [], 0
    for title, row in rows:
        grid = {"h": 1, "w": 24, "x": 0, "y": y}
        panels.append(
            {"id": 0, "type": "row", "title": title, "collapsed": False, "gridPos": grid, "panels": []}
        )
        y, x, row_h = y + 1, 0, 0
        for p in row:
            pos = p["gridPos"]
            if x + pos["w"] > 24:
                x, y, row_h = 0, y + row_h, 0
            pos["x"], pos["y"] = x, y
            panels.append(p)
            x, row_h = x + pos["w"], max(row_h, pos["h"])
        y += row_h
    for pid, p in enumerate(panels, 1):
        p["id"] = pid
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
