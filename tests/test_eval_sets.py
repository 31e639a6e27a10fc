"""Eval sets: pass@k's unbiased estimator against brute force; several named sets through a
real evaluator (in-process model, the producers' server, an eval server of its own) with
their series per set in the exporter; a set whose rows lack the reward's fields."""

from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction

import msgspec
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumers.exporter import Exporter
from consumers.metrics_state import State, capture, restore
from producers import eval_rollouts, eval_sets
from producers.components import eval_sampler
from producers.eval_sets import RowScores, pass_at_k, summarize
from producers.evaluator import Evaluator
from producers.fake_server import FakeCompletionsServer
from producers.render import Renderer
from producers.samplers import Completion
from schemas import MetricsEvent, WeightSync, decode, encode
from schemas.metric_names import EVAL
from streamer import cli, demo, models, weights
from streamer.bus import Publisher
from streamer.cli import plot
from streamer.cli.progress import Progress
from streamer.config import RunConfig, parse_config, replace
from streamer.errors import ConfigError, DatasetError
from streamer.readmodel import read_history
from streamer.rollout.contract import Episode, Segment, Task


def _brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (c of them right) holding a right one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_on_every_small_case():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == float(_brute_pass_at_k(n, c, k)), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))
    for bad in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_and_mean_at_k_of_a_set_count_missing_samples_as_failures():
    rows = [
        RowScores([1.0, 0.0, 1.0, 0.0], [True, False, True, False], [3, 4, 5, 6]),
        RowScores([0.5], [True], [2]),  # 3 of its 4 samples never came back
        RowScores([], [], []),  # its rollout failed
    ]
    got = summarize(rows, n=4, k=2)
    assert got["mean_at_k"] == got["accuracy"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    expected = (float(_brute_pass_at_k(4, 2, 2)) + float(_brute_pass_at_k(4, 1, 2)) + 0.0) / 3
    assert got["pass_at_k"] == pytest.approx(expected)
    assert got["reward_mean"] == pytest.approx(2.5 / 12)
    assert got["response_length_mean"] == pytest.approx(20 / 5)
    assert (got["rows"], got["k"], got["samples"]) == (3, 2, 4)


def _cfg(keys, redis_url, tmp_path, *, sets: dict, **sections) -> RunConfig:
    return replace(
        demo.config(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        eval={"eval_every": 1, "max_rows": 6, "batch_size": 4, "sets": sets, **sections.pop("eval", {})},
        **sections,
    )


def _evaluator(cfg, client) -> Evaluator:
    tokenizer = models.load_tokenizer(cfg.model)
    sampler, stops = eval_sampler(cfg, tokenizer)
    renderer = Renderer(tokenizer, chat_template=cfg.model.chat_template, extra_stop_ids=stops)
    return Evaluator(cfg, client=client, sampler=sampler, sets=eval_sets.prepare(cfg), renderer=renderer)


def _events(client, keys) -> list[MetricsEvent]:
    return [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]


def _sync(client, keys, cfg, version: int) -> None:
    uri, digest = weights.write_version(demo.build_model(seed=version), cfg.weights_dir, version)
    client.xadd(
        keys.policy, {b"d": encode(WeightSync(version=version, step=version, uri=uri, sha256=digest))}
    )


def _served(cfg) -> dict[tuple[str, str], float]:
    """What the exporter serves, replayed from the run's metrics stream: {(name, set): value}."""
    ex = Exporter(replace(cfg, metrics={"port": 0}))
    try:
        ex.bootstrap()
        text = generate_latest(ex.registry).decode()
    finally:
        ex.close()
    return {
        (s.name, s.labels.get("set", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("streamer_eval_")
    }


def test_eval_sets_of_an_in_process_model_each_publish_their_metrics_and_series(
    client, keys, redis_url, tmp_path
):
    sets = {
        "sampled": {"dataset": "demo", "k": 2, "samples": 3, "temperature": 1.0, "max_rows": 5},
        "retry": {
            "dataset": "demo:retry",
            "rollout": "streamer.rollout.tasks:retry",
            "k": 2,
            "temperature": 1.0,
        },
    }
    cfg = _cfg(keys, redis_url, tmp_path, sets=sets, eval={"max_versions": 2})
    ev = _evaluator(cfg, client)
    ev.start()
    _sync(client, keys, cfg, 1)
    assert ev.step() == 1

    events = _events(client, keys)
    assert [(e.step, e.eval_set) for e in events] == [
        (v, name) for v in (0, 1) for name in ("default", "sampled", "retry")
    ]
    by = {(e.step, e.eval_set): e.values for e in events}
    for v in (0, 1):
        assert set(by[v, "sampled"]) == set(EVAL)
        assert (by[v, "default"]["rows"], by[v, "default"]["k"], by[v, "default"]["samples"]) == (6, 1, 1)
        assert (by[v, "sampled"]["rows"], by[v, "sampled"]["k"], by[v, "sampled"]["samples"]) == (5, 2, 3)
        assert (by[v, "retry"]["rows"], by[v, "retry"]["k"]) == (len(demo.rows("eval")), 2)
        for name in ("default", "sampled", "retry"):
            m = by[v, name]
            assert m["mean_at_k"] == m["accuracy"] <= m["pass_at_k"] <= 1, (v, name, m)
    # the default set is still the greedy demo metric: the same numbers as one greedy pass
    (default, *_) = ev.sets
    greedy = [ev.sampler.sample(p, n=1, temperature=0, top_p=1, max_new_tokens=2)[0] for p in default.prompts]
    right = [
        demo.reward(r, default.task.renderer.decode(c.token_ids)) for r, c in zip(default.spec.rows, greedy)
    ]
    assert by[1, "default"]["accuracy"] == pytest.approx(sum(right) / 6) == by[1, "default"]["pass_at_k"]

    served = _served(cfg)
    for name in ("default", "sampled", "retry"):
        for metric in ("accuracy", "pass_at_k", "mean_at_k", "k", "rows"):
            assert served[f"streamer_eval_{metric}", name] == by[1, name][metric], (metric, name)
    assert served["streamer_eval_step", ""] == 1


def _remote_backend(tokenizer, stop_id: int, right_of):
    """A fake engine whose k-th completion of a prompt is right iff k < right_of(a, b, n)."""

    def backend(body: dict) -> list[Completion]:
        a, b = map(int, re.search(r"(\d)\+(\d)=", tokenizer.decode(body["prompt"])).groups())
        n = int(body["n"])
        good, bad = str(a + b), str((a + b + 1) % 10)
        out = []
        for i in range(n):
            ids = [
                *tokenizer.encode(good if i < right_of(a, b, n) else bad, add_special_tokens=False),
                stop_id,
            ]
            out.append(Completion(ids, [-0.1] * len(ids), "stop"))
        return out

    return backend


@pytest.mark.parametrize("where", ["producers' server", "eval server", "eval server, down at first"])
def test_eval_sets_sample_through_a_server_and_score_pass_at_k_exactly(
    where, client, keys, redis_url, tmp_path
):
    tokenizer = demo.tokenizer()

    def right_of(a: int, b: int, n: int) -> int:
        return (a + 2 * b) % (n + 1)

    fake = FakeCompletionsServer(_remote_backend(tokenizer, tokenizer.eos_token_id, right_of)).start()
    try:
        server = {"sampler": "remote", "remote_url": fake.url} if where == "producers' server" else {}
        down = 5 if where.endswith("down at first") else 0
        fake.fail_next(down)  # 503s: an outage is waited out, never scored
        cfg = _cfg(
            keys,
            redis_url,
            tmp_path,
            sets={"pass4": {"dataset": "demo", "k": 2, "samples": 4, "temperature": 0.7}},
            producer={**server, "remote_retries": 0},
            eval={"remote_url": fake.url} if where.startswith("eval server") else {},
        )
        ev = _evaluator(cfg, client)
        assert not ev.in_process  # every engine call goes to the server
        ev.start()
        _sync(client, keys, cfg, 1)
        assert ev.step() == 1
    finally:
        fake.stop()
    rows = demo.rows("eval")
    pairs = [tuple(map(int, re.match(r"(\d)\+(\d)=", r["messages"][0]["content"]).groups())) for r in rows]
    expected = sum(pass_at_k(4, right_of(a, b, 4), 2) for a, b in pairs) / len(pairs)
    default = sum(right_of(a, b, 1) for a, b in pairs[:6]) / 6
    by = {(e.step, e.eval_set): e.values for e in _events(client, keys)}
    for v in (0, 1):
        assert by[v, "pass4"]["pass_at_k"] == pytest.approx(expected)
        assert by[v, "pass4"]["mean_at_k"] == pytest.approx(sum(right_of(a, b, 4) / 4 for a, b in pairs) / 10)
        assert by[v, "default"]["accuracy"] == pytest.approx(default) == by[v, "default"]["pass_at_k"]
    settings = {(b["n"], b["temperature"]) for b in fake.bodies}
    assert settings == {(1, 0.0), (4, 0.7)}, settings
    assert fake.reloads == [str(weights.version_dir(cfg.weights_dir, 1))]  # version 1 reached the engine
    assert fake.requests >= 2 * (6 + 10) + down


def test_eval_sets_rows_without_the_rewards_field_are_a_config_error_naming_the_set(
    keys, redis_url, tmp_path, monkeypatch, capsys
):
    rows = tmp_path / "held_out.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nname = "{keys.run}"\nredis_url = "{redis_url}"\ndata_dir = "{tmp_path}"\n'
        f'[eval.sets.arith]\ndataset = "{rows}"\nreward = "producers.rewards:exact_match"\n'
    )

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the eval sets were checked")

    monkeypatch.setattr(models, "load_tokenizer", no_model)
    monkeypatch.setattr(models, "load_model", no_model)
    for command in ("eval", "up"):
        assert cli.main([command, "--config", str(config)]) == 2, command
        err = capsys.readouterr().err
        assert "eval set 'arith'" in err and "row 1" in err and "`answer`" in err, err
    cfg = replace(RunConfig(), eval={"sets": {"arith": {"dataset": str(rows)}}})
    cfg = replace(cfg, producer={"reward": "producers.rewards:exact_match"})
    with pytest.raises(DatasetError, match="eval set 'arith'"):
        eval_sets.prepare(cfg)
    cfg = replace(RunConfig(), eval={"sets": {"agent": {"dataset": "demo", "rollout": "no_such_module:run"}}})
    with pytest.raises(DatasetError, match="eval set 'agent'.*no_such_module"):
        eval_sets.prepare(cfg)


def _set_event(version: int, name: str, accuracy: float, best: float, k: int) -> MetricsEvent:
    values = {"accuracy": accuracy, "mean_at_k": accuracy, "pass_at_k": best, "k": float(k)}
    return MetricsEvent(axis="eval", step=version, values=values, source="eval", eval_set=name)


def test_eval_sets_keep_their_series_across_an_exporter_snapshot_and_their_own_curves(
    client, keys, redis_url, tmp_path
):
    events = [
        MetricsEvent(axis="eval", step=0, values={"accuracy": 0.1}, source="eval"),  # names no set
        _set_event(0, "math", 0.2, 0.5, 4),
        _set_event(5, "default", 0.3, 0.3, 1),
        _set_event(5, "math", 0.4, 0.75, 4),
    ]
    Publisher(client, keys, RunConfig().bus).publish_many(keys.metrics, events)
    cfg = replace(RunConfig(), run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)})
    first = Exporter(replace(cfg, metrics={"port": 0}))
    first.bootstrap()
    first.save_snapshot()
    first.close()
    client.xtrim(keys.metrics, maxlen=0)  # only the snapshot is left to restore from
    served = _served(cfg)
    assert (
        served["streamer_eval_accuracy", "default"] == 0.3 and served["streamer_eval_accuracy", "math"] == 0.4
    )
    assert served["streamer_eval_pass_at_k", "math"] == 0.75 and served["streamer_eval_k", "math"] == 4

    history = read_history(client, keys)
    assert history.headline_set == "default" and history.eval_accuracy == 0.3  # the headline: default
    assert history.eval_by_version.means() == {0: 0.1, 5: 0.3}
    math_curves = history.eval_sets["math"]
    assert math_curves.k == 4 and math_curves.pass_at_k.means() == {0: 0.5, 5: 0.75}
    assert history.eval_sets["default"].accuracy.means() == {0: 0.1, 5: 0.3}
    progress = Progress(cfg, target_steps=0, live=False)  # `up`'s view, from the same snapshot
    summary = progress.summary(1.0, tmp_path)
    progress.client.close()
    assert "eval accuracy      0.30 (version 5)" in summary, summary
    assert "eval set math      mean@4 0.40, pass@4 0.75 (version 5)" in summary, summary
    pytest.importorskip("matplotlib")
    assert plot.draw(history, tmp_path / "run.png", title="sets").stat().st_size > 20_000


def test_eval_sets_restore_a_snapshot_saved_before_sets_under_the_default_set():
    state = State()
    state.apply("1-0", MetricsEvent(axis="eval", step=3, values={"accuracy": 0.5}, source="eval"))
    snap = capture(state)
    old = msgspec.structs.replace(  # as an exporter without sets saved it
        snap, gauges={"streamer_eval_accuracy": 0.5}, set_gauges=[], sets={}
    )
    restored = restore(old)
    assert restored.set_gauges == {("streamer_eval_accuracy", "default"): 0.5}
    assert "streamer_eval_accuracy" not in restored.gauges


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[eval.sets.math]\nk = 4\n", "key `eval.sets.math.dataset`: is required"),
        ('[eval.sets.math]\ndataset = "demo"\nk = 0\n', "key `eval.sets.math.k`: must be >= 1"),
        ('[eval.sets.math]\ndataset = "demo"\nkk = 2\n', "unknown key `eval.sets.math.kk`"),
        ('[eval.sets.math]\ndataset = "demo"\nk = 4\n', "key `eval.sets.math.temperature`: = 0 is greedy"),
        (
            '[eval.sets.math]\ndataset = "demo"\nk = 4\nsamples = 2\ntemperature = 1.0\n',
            "key `eval.sets.math.samples`: (2) must be >= `k` (4)",
        ),
        ('[eval.sets.default]\ndataset = "demo"\n', "set named 'default'"),
        ('[eval.sets."a b"]\ndataset = "demo"\n', "set named 'a b'"),
        ('[eval]\ndataset = ""\n', "nothing to evaluate"),
    ],
)
def test_eval_sets_config_errors_name_the_set_and_the_key(toml, message):
    with pytest.raises(ConfigError) as err:
        parse_config(toml)
    assert message in str(err.value), str(err.value)


def test_eval_sets_label_is_bounded(monkeypatch):
    monkeypatch.setattr("consumers.metrics_state.MAX_SET_LABELS", 2)
    state = State()
    for i, name in enumerate(("", "a", "b", "c")):
        state.apply(
            f"{i + 1}-0",
            MetricsEvent(axis="eval", step=1, values={"rows": float(i)}, source="eval", eval_set=name),
        )
    assert state.set_gauges == {
        ("streamer_eval_rows", "default"): 0.0,
        ("streamer_eval_rows", "a"): 1.0,
        ("streamer_eval_rows", "other"): 3.0,  # b, then c: the latest
    }


def test_eval_sets_rollouts_get_a_fresh_copy_of_each_row_every_evaluation():
    async def mutating(row: dict, ctx) -> list[Episode]:
        row["messages"].append({"role": "user", "content": "again"})  # a rollout that writes its row
        return [Episode([Segment([1, 2])], reward=float(len(row["messages"])))]

    rows = demo.rows("eval")[:3]
    task = Task(rows=rows, renderer=None, reward_fn=demo.reward, reward_path="streamer.demo:reward")
    for _ in range(2):
        out = eval_rollouts.evaluate(rows, task=task, sampler=object(), rollout=mutating, max_new_tokens=2)
        assert [[e.reward for e in eps] for eps in out] == [[2.0]] * 3
    assert all(len(r["messages"]) == 1 for r in rows)
