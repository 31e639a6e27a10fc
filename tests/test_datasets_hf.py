"""Rows through HF datasets: parquet, Arrow, JSONL and directories read by index on demand,
with the JSONL reader's rules and errors; weighted sources mixed into one ticket order that a
checkpointed position resumes; a producer's memory does not grow with the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
import pyarrow.ipc as ipc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from producers import dataset  # noqa: E402
from producers.components import build  # noqa: E402
from producers.dataset import Order, check_required, load_rows  # noqa: E402
from producers.lazy_rows import Rows  # noqa: E402
from producers.mix import Mixed, MixedOrder, order_of, quotas, training_rows  # noqa: E402
from streamer import demo, position  # noqa: E402
from streamer.admission import Leases  # noqa: E402
from streamer.config import ConfigError, RunConfig, parse_config, replace, to_toml  # noqa: E402
from streamer.errors import DatasetError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = demo.rows("train")


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the file ``path``'s suffix says: .parquet, .arrow (IPC file; .stream.arrow:
    the stream format datasets writes) or .jsonl."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    table = pa.Table.from_pylist(rows, schema=_schema(rows))
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        new = ipc.new_stream if path.name.endswith(".stream.arrow") else ipc.new_file
        with new(path, table.schema) as w:
            w.write_table(table)
    return path


def _schema(rows: list[dict]) -> pa.Schema:
    """Every row's columns (pyarrow's from_pylist would take the first row's only)."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows]).schema


def cfg_in(tmp_path: Path, **sections) -> RunConfig:
    sections["run"] = {"data_dir": str(tmp_path / "data"), **sections.get("run", {})}
    return replace(RunConfig(), **sections)


# ---------------------------------------------------------------- files and directories


@pytest.mark.parametrize("name", ["rows.parquet", "rows.arrow", "rows.stream.arrow", "rows.jsonl"])
def test_a_file_is_read_by_index_and_gives_the_rows_it_holds(tmp_path, name):
    path = write(tmp_path / name, ROWS)
    rows = load_rows(str(path), cache_dir=tmp_path / "cache")
    assert isinstance(rows, Rows) and len(rows) == len(ROWS)
    assert rows[7] == ROWS[7] and rows[-1] == ROWS[-1] and list(rows) == ROWS
    view = rows[10:20]
    assert len(view) == 10 and view[0] == ROWS[10] and list(view[2:4]) == ROWS[12:14]
    assert rows[7] is not rows[7], "each read is a new dict: a rollout that edits it changes nothing"
    with pytest.raises(IndexError):
        rows[len(ROWS)]


def test_a_directory_is_its_data_files_in_name_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write(d / "a.parquet", ROWS[:10])
    write(d / "b.jsonl", ROWS[10:30])
    write(d / "c.arrow", ROWS[30:])
    (d / "README.md").write_text("not rows")
    rows = load_rows(str(d), cache_dir=tmp_path / "cache")
    assert list(rows) == ROWS
    assert rows.where(12) == f"{d / 'b.jsonl'}:3" and rows.where(31) == f"{d / 'c.arrow'} row 1"
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    assert list(load_rows(str(saved), cache_dir=tmp_path / "cache")) == ROWS
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .parquet, .arrow, .jsonl, .json files"):
        load_rows(str(tmp_path / "empty"), cache_dir=tmp_path / "cache")


def test_jsonl_through_arrow_is_the_dicts_the_lines_hold(tmp_path):
    lines = [
        {"prompt": "a", "answer": 4, "meta": {"k": 1}},
        {"prompt": "b", "answer": 4.5},
        {"prompt": "c", "answer": "x", "extra": [1, 2]},
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "n"},
                {"role": "assistant", "content": "yo"},
            ]
        },
    ]
    rows = load_rows(str(write(tmp_path / "r.jsonl", lines)), cache_dir=tmp_path / "cache")
    assert isinstance(rows, Rows) and list(rows) == lines  # 4 stays 4; absent keys stay absent
    assert type(rows[0]["answer"]) is int and type(rows[1]["answer"]) is float


def test_without_datasets_jsonl_is_read_into_memory_and_parquet_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "has_datasets", lambda: False)
    rows = load_rows(str(write(tmp_path / "r.jsonl", ROWS)))
    assert isinstance(rows, list) and rows == ROWS
    for source in (str(write(tmp_path / "r.parquet", ROWS)), str(tmp_path), "hf:openai/gsm8k"):
        with pytest.raises(DatasetError, match=r"needs HF datasets: pip install 'streamer-rl\[datasets\]'"):
            load_rows(source)


def test_a_changed_file_is_converted_again(tmp_path):
    path = write(tmp_path / "r.parquet", ROWS[:5])
    assert len(load_rows(str(path), cache_dir=tmp_path / "cache")) == 5
    write(path, ROWS[:9])
    os.utime(path, (1, 1))  # the cache is keyed by path and modification time
    assert list(load_rows(str(path), cache_dir=tmp_path / "cache")) == ROWS[:9]


# ---------------------------------------------------------------- the row rule, before work


BAD = [
    ({"answer": "4"}, "a row needs `messages` (a chat) or `prompt` (a string)"),
    ({"prompt": ""}, "`prompt` must be a non-empty string"),
    ({"messages": []}, "`messages` must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "messages[0] needs a string `content`"),
    ({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, "messages[1] needs a string `role`"),
]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize(("row", "reason"), BAD)
def test_a_bad_row_is_named_with_the_jsonl_readers_error(tmp_path, suffix, row, reason):
    good = {"messages": [{"role": "user", "content": "1+1="}], "prompt": "p", "answer": "2"}
    path = write(tmp_path / f"bad{suffix}", [good, good, row])
    with pytest.raises(DatasetError) as e:
        load_rows(str(path), cache_dir=tmp_path / "cache")
    where = f"{path}:3" if suffix == ".jsonl" else f"{path} row 2"
    assert str(e.value) == f"{where}: {reason}"


def test_a_bad_row_deep_in_a_large_file_is_found_by_the_column_checks(tmp_path):
    n = 150_000  # more rows than one slice of the checks
    chat = pa.array([[{"role": "user", "content": f"{i}="}] for i in range(n)])
    chat = pa.array(
        chat.to_pylist()[:123_456] + [[{"role": "user", "content": None}]] + chat.to_pylist()[123_457:]
    )
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"messages": chat, "answer": [str(i) for i in range(n)]}), path)
    with pytest.raises(DatasetError, match=r"big.parquet row 123456: messages\[0\] needs a string `content`"):
        load_rows(str(path), cache_dir=tmp_path / "cache")


def test_a_row_without_the_rewards_field_is_refused_before_any_model_loads(tmp_path):
    rows = [dict(r) for r in ROWS]
    for i in (5, 9):
        del rows[i]["answer"]
    source = str(write(tmp_path / "rows.parquet", rows))
    cfg = cfg_in(tmp_path, producer={"dataset": source, "reward": "streamer.demo:reward"})
    with pytest.raises(DatasetError) as e:
        build(cfg)
    assert (
        str(e.value)
        == f"{source}: row 5 (and 1 more) has no `answer`, which the reward streamer.demo:reward needs"
    )
    jsonl = str(write(tmp_path / "rows.jsonl", rows))
    with pytest.raises(DatasetError, match=rf"row 5 \(and 1 more\) has no `answer`.* \(row 5 is {jsonl}:6\)"):
        check_required(load_rows(jsonl, cache_dir=tmp_path / "cache"), ["answer"], source=jsonl, reward="r")
    mixed = cfg_in(
        tmp_path,
        producer={"reward": "streamer.demo:reward"},
        dataset={"sources": [{"path": "demo"}, {"path": source, "weight": 2.0}]},
    )
    with pytest.raises(
        DatasetError, match=rf"row 50 \(and 1 more\) has no `answer`.*\(row 50 is {source} row 5\)"
    ):
        build(mixed)


def test_a_hub_dataset_without_a_network_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="is not hf:owner/name"):
        load_rows("hf:gsm8k")
    code = "from producers.dataset import load_rows\nload_rows('hf:openai/gsm8k/main', cache_dir=__import__('sys').argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
        },  # fails at once, as no network does
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "DatasetError: cannot load hf:openai/gsm8k/main from the hub" in proc.stderr, proc.stderr[-2000:]
    assert "reaches huggingface.co" in proc.stderr


# ---------------------------------------------------------------- weighted sources


def test_quotas_follow_the_weights_and_fill_the_epoch():
    assert quotas(10, [1, 1]).tolist() == [5, 5]
    assert quotas(10, [2, 1]).tolist() == [7, 3] and quotas(7, [1, 1, 1]).tolist() == [3, 2, 2]
    q = quotas(1_350, [1.0, 2.0, 0.5])
    assert q.sum() == 1_350 and np.allclose(q / 1_350, [1 / 3.5, 2 / 3.5, 0.5 / 3.5], atol=1 / 1_350)


def test_a_mixed_order_gives_each_source_its_share_and_walks_its_rows():
    lengths, weights = [1_000, 50, 300], [1.0, 2.0, 1.0]
    order = MixedOrder(lengths, weights, seed=7)
    n, bounds = order.n_rows, np.cumsum([0, *lengths])
    source = lambda row: int(np.searchsorted(bounds, row, side="right") - 1)  # noqa: E731
    for epoch in range(3):
        rows = [order.position(t).row for t in range(epoch * n, (epoch + 1) * n)]
        shares = Counter(source(r) for r in rows)
        for s, w in enumerate(weights):
            assert abs(shares[s] / n - w / sum(weights)) <= 1 / n, (epoch, s, shares)
    first = [order.position(t).row for t in range(3 * n)]
    big = [[r for r in first[e * n : (e + 1) * n] if source(r) == 0] for e in range(3)]
    assert len(set(big[0] + big[1])) == 2 * 338, "steps 0-675 of its walk: one pass, no row twice"
    assert set(big[0] + big[1] + big[2]) == set(range(1_000)), "three epochs walk them all"
    small = Counter(r for r in first[:n] if source(r) == 1)  # 50 rows, 675 tickets: 13 or 14 each
    assert set(small) == set(range(1_000, 1_050)) and max(small.values()) - min(small.values()) <= 1
    again = MixedOrder(lengths, weights, seed=7)
    assert [again.position(t).row for t in range(3 * n)] == first, "deterministic: every producer agrees"
    assert [MixedOrder(lengths, weights, seed=8).position(t).row for t in range(n)] != first[:n]
    window = np.frombuffer(order.window(n - 5, 20), dtype="<u4").tolist()
    assert window == first[n - 5 : n + 15]


def test_sources_replace_producer_dataset_and_one_source_is_the_plain_order(tmp_path):
    a = str(write(tmp_path / "a.parquet", ROWS[:20]))
    b = str(write(tmp_path / "b.jsonl", ROWS[20:]))
    cfg = cfg_in(tmp_path, dataset={"sources": [{"path": a, "weight": 3.0}, {"path": b}]})
    rows = training_rows(cfg)
    assert isinstance(rows, Mixed) and list(rows) == ROWS
    order = order_of(rows, seed=cfg.run.seed)
    assert isinstance(order, MixedOrder) and order.quotas.tolist() == [34, 11]
    assert (tmp_path / "data" / "datasets").is_dir(), "conversions go under {data_dir}/datasets"
    one = training_rows(cfg_in(tmp_path, dataset={"sources": [{"path": a, "weight": 3.0}]}))
    assert type(order_of(one, seed=0)) is Order
    with pytest.raises(ConfigError, match="key `producer.dataset`: is .* but \\[\\[dataset.sources\\]\\]"):
        cfg_in(tmp_path, producer={"dataset": a}, dataset={"sources": [{"path": b}]})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ('path = "a.parquet"\nsplit = "test"', "key `dataset.sources[0].split`: chooses a split of a hub"),
        (
            'path = "a.parquet"\nname = "main"',
            "key `dataset.sources[0].name`: is a hub dataset's configuration",
        ),
        (
            'path = "hf:o/n:train"\nsplit = "test"',
            "key `dataset.sources[0].path`: 'hf:o/n:train' names its split",
        ),
        ('path = "hf:o"', "key `dataset.sources[0].path`: 'hf:o' is not hf:owner/name"),
        ('path = "a.parquet"\nweight = 0.0', "key `dataset.sources[0].weight`: must be > 0"),
        ("weight = 1.0", "key `dataset.sources[0].path`: is required"),
    ],
)
def test_bad_sources_name_the_key(source, message):
    with pytest.raises(ConfigError) as e:
        parse_config(f"[[dataset.sources]]\n{source}\n", source="run.toml")
    assert message in str(e.value)


def test_a_sources_name_is_the_hub_datasets_configuration():
    (a, b, c) = parse_config(
        '[[dataset.sources]]\npath = "hf:o/n"\nname = "main"\nsplit = "test"\n'
        '[[dataset.sources]]\npath = "hf:o/n:test"\nname = "main"\n'
        '[[dataset.sources]]\npath = "data/x.parquet"\n'
    ).dataset.sources
    assert (a.dataset, b.dataset, c.dataset) == ("hf:o/n/main", "hf:o/n/main:test", "data/x.parquet")


def test_sources_round_trip_through_the_toml_up_writes(tmp_path):
    import msgspec

    cfg = cfg_in(
        tmp_path, dataset={"sources": [{"path": "a.parquet", "weight": 2.5}, {"path": "hf:o/n/c:test"}]}
    )
    assert parse_config(to_toml(msgspec.to_builtins(cfg))) == cfg


def test_a_restart_from_the_checkpointed_position_resumes_the_mixed_order_in_place(client, keys, tmp_path):
    a = str(write(tmp_path / "a.parquet", ROWS[:30]))
    b = str(write(tmp_path / "b.jsonl", ROWS[30:]))
    cfg = cfg_in(
        tmp_path,
        run={"seed": 3},
        dataset={"sources": [{"path": a, "weight": 1.0}, {"path": b, "weight": 2.0}]},
    )
    rows = training_rows(cfg)
    order = order_of(rows, seed=cfg.run.seed)
    expected = [rows[order.position(t).row] for t in range(120)]  # the run that never stopped

    leases = Leases(client, keys, owner="p", lease_seconds=30)
    claimed = [leases.claim() for _ in range(100)]
    for t in claimed[:97]:
        leases.finish(t)  # 97, 98 and 99 are still being worked on
    saved = position.read(client, keys)
    for key in client.scan_iter(match=keys.all_keys_pattern(), count=1000):
        client.delete(key)  # the server restarted empty
    assert position.recover(client, keys, saved) == 3

    again = training_rows(cfg)  # a producer started afresh: rows and order rebuilt from the config
    order_again = order_of(again, seed=cfg.run.seed)
    leases = Leases(client, keys, owner="q", lease_seconds=30)
    resumed = [leases.claim() for _ in range(20)]
    assert resumed == [97, 98, 99, *range(100, 117)]
    assert [again[order_again.position(t).row] for t in resumed] == [expected[t] for t in resumed]


# ---------------------------------------------------------------- a producer on mixed rows


def test_a_producer_publishes_the_rows_of_the_mixed_order(client, keys, redis_url, tmp_path):
    from producers.producer import Producer
    from schemas import TrajectoryGroup, decode

    a = str(write(tmp_path / "a.parquet", ROWS[:20]))
    b = str(write(tmp_path / "b.jsonl", ROWS[20:]))
    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={
            "group_size": 2,
            "max_new_tokens": 2,
            "max_groups": 6,
            "torch_threads": 1,
            "defer_after": 0,
        },
        trainer={"groups_per_step": 1000},
        dataset={"sources": [{"path": a, "weight": 3.0}, {"path": b}]},
    )
    task, sampler = build(cfg)
    assert task.reward_path == "producers.rewards:exact_match"  # not the demo's: the rows are files
    assert Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler).run() == 0
    groups = [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]
    order = order_of(task.rows, seed=cfg.run.seed)
    positions = [order.position(t) for t in range(6)]  # one producer, one row at a time: tickets 0-5
    assert sorted((g.epoch, g.row) for g in groups) == sorted((p.epoch, p.row) for p in positions)
    for g in groups:
        prompt = demo.tokenizer().decode(g.samples[0].token_ids()[: g.samples[0].prompt_len].tolist())
        assert task.rows[g.row]["messages"][0]["content"] in prompt


# ---------------------------------------------------------------- memory


MEASURE = r"""
import json, random, sys
from producers import dataset
from producers.mix import order_of
import datasets  # imported before the baseline: the rows' memory is what is measured

def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024

before = anon()
rows = dataset.load_rows(sys.argv[1], cache_dir=sys.argv[2])
dataset.check_required(rows, ["answer"], source="m", reward="m")
order = order_of(rows, seed=0)
for t in random.Random(0).sample(range(len(rows)), 2000):
    assert rows[order.position(t).row]["answer"]
print(json.dumps({"rows": len(rows), "anon_growth": anon() - before}))
"""


def test_a_producers_own_memory_does_not_grow_with_the_file(tmp_path):
    n = 300_000
    rng = np.random.default_rng(0)
    prompts = [" ".join(f"w{x:x}" for x in rng.integers(0, 4096, 30)) for _ in range(n)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": [str(i) for i in range(n)]}), path)
    size = path.stat().st_size

    def measure() -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", MEASURE, str(path), str(tmp_path / "cache")],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["rows"] == n
        return got

    measure()  # the first producer converts the parquet into the cache
    grew = measure()["anon_growth"]  # every later one maps it
    # the rows in dicts would take ~7x the file (bench/dataset_memory.py); mapped, a producer's
    # own memory grows by the order's 4 bytes a row and fixed costs
    assert grew < size / 4, f"anonymous memory grew {grew:,} B for a {size:,} B file"


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_up_trains_on_weighted_parquet_and_jsonl_sources(tmp_path):
    import msgspec
    from bounds import RUN
    from runs import Up

    from streamer.config import write_toml

    a = str(write(tmp_path / "a.parquet", ROWS[:30]))
    b = str(write(tmp_path / "b.jsonl", ROWS[30:]))
    held_out = str(write(tmp_path / "eval.parquet", demo.rows("eval")))
    tree = msgspec.to_builtins(demo.config())
    tree["dataset"]["sources"] = [{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}]
    tree["eval"].update(dataset=held_out, eval_every=1)
    config = write_toml(tmp_path / "run.toml", tree)
    with Up(tmp_path, "--config", str(config), "--steps", "3") as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0, out
    assert "steps trained      3" in out, out
    logs = tmp_path / "demo" / "logs"
    produce = (logs / "produce-0.log").read_text()
    assert f"{a}: 30 rows, memory-mapped" in produce and f"{b}: 15 rows, memory-mapped" in produce, produce
    assert (tmp_path / "datasets").is_dir(), "conversions under {data_dir}/datasets"
    curve = json.loads((tmp_path / "demo" / "curve.json").read_text())
    assert "3" in curve["eval_accuracy_by_version"], curve  # the held-out parquet was scored
