"""The rollout archive: every group as text on disk, `streamer samples` / `streamer dead`,
bounded trimming lag, and a broken disk that stops archiving without holding anything."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from trainer_data import make_group, publish

from consumers import advantages
from consumers.archive import Archiver, RotatingWriter, advantage_of, archive_dir
from schemas import DeadLetter, Span, encode
from streamer import cli, demo
from streamer.bus import FIELD, entry, trim_acked
from streamer.config import RunConfig, replace
from streamer.keys import ARCHIVE_GROUP, TRAINER_GROUP

ROOT = Path(__file__).resolve().parents[1]


def _cfg(keys, redis_url, tmp_path, **archive) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path / "data")},
        archive=archive,
    )


def _args(cfg, *extra: str) -> list[str]:
    return ["--run", cfg.run.name, "--data-dir", cfg.run.data_dir, "--redis-url", cfg.run.redis_url, *extra]


def test_every_group_is_archived_as_text_and_samples_prints_it(client, keys, redis_url, tmp_path, capsys):
    cfg = _cfg(keys, redis_url, tmp_path)
    rng = random.Random(0)
    groups = [make_group(rng, rewards=(1.0, 0.0), row=i) for i in range(5)]
    groups.append(make_group(rng, rewards=(1.0, 1.0), row=5))  # zero variance: rejected
    ids = publish(client, keys.traj, groups)
    archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
    while archiver.step(block=0.1):
        pass
    archiver.close()
    assert archiver.archived == 6 and archiver.skipped == 0
    assert cli.main(["samples", *_args(cfg, "--last", "2")]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 2 and ids[-1] in out and ids[0] not in out
    assert "zero_variance" in out and "accepted" in out
    prompt = demo.tokenizer().decode(
        groups[-1].samples[0].token_ids()[: groups[-1].samples[0].prompt_len].tolist()
    )
    assert repr(prompt) in out and "adv +" in out
    assert cli.main(["samples", *_args(cfg, "--last", "10", "--min-reward", "0.5")]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 6 and "reward +0.000" not in out
    info = {g["name"].decode(): g for g in client.xinfo_groups(keys.traj)}
    assert info[ARCHIVE_GROUP]["pending"] == 0


def test_a_completion_two_versions_sampled_shows_each_ones_tokens(client, keys, redis_url, tmp_path, capsys):
    cfg = _cfg(keys, redis_url, tmp_path)
    group = make_group(random.Random(1), rewards=(1.0, 0.0), row=0)
    first = group.samples[0]
    n = first.completion_len
    spans = [Span(0, 1, 3), Span(1, n, 4)] if n > 1 else [Span(0, n, 3)]
    two = msgspec.structs.replace(first, version=3, spans=spans)
    group = msgspec.structs.replace(group, samples=[two, *group.samples[1:]], policy_version=0)
    publish(client, keys.traj, [group])
    archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
    while archiver.step(block=0.1):
        pass
    archiver.close()
    assert cli.main(["samples", *_args(cfg, "--last", "1")]) == 0
    out = capsys.readouterr().out
    assert f"v3[0:1] v4[1:{n}]" in out, out


def test_a_stopping_archiver_archives_what_arrived_since_its_last_read(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path)
    rng = random.Random(0)
    publish(client, keys.traj, [make_group(rng, rewards=(1.0, 0.0), row=i) for i in range(3)])
    archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
    stop = threading.Event()
    reads = []
    step = archiver.step
    archiver.step = lambda block=None: reads.append(step(block=block)) or reads[-1]
    runner = threading.Thread(target=archiver.run, args=(stop,))
    runner.start()
    deadline = time.monotonic() + 10
    while not reads and time.monotonic() < deadline:
        time.sleep(0.01)
    # published while it waits for more to gather: one batch, read as it stops
    publish(client, keys.traj, [make_group(rng, rewards=(1.0, 0.0), row=i) for i in range(3, 7)])
    stop.set()
    runner.join(10)
    archiver.close()
    assert reads[0] == 3 and sum(reads) == archiver.archived == len(_records(cfg)) == 7
    info = {g["name"].decode(): g for g in client.xinfo_groups(keys.traj)}
    assert info[ARCHIVE_GROUP]["pending"] == 0 and info[ARCHIVE_GROUP]["lag"] == 0


def _records(cfg) -> list[dict]:
    return [json.loads(line) for f in sorted(archive_dir(cfg).glob("*.gz")) for line in gzip.open(f, "rt")]


def test_archive_advantages_are_the_trainers_and_the_verdict_says_who_judged(
    client, keys, redis_url, tmp_path, capsys
):
    cfg = replace(_cfg(keys, redis_url, tmp_path), trainer={"advantage": "rloo", "overlong": "drop"})
    rng = random.Random(1)
    groups = [
        make_group(rng, rewards=(1.0, 0.0, 0.0, 1.0)),
        make_group(rng, rewards=(1.0, 0.0, 1.0), finishes=["stop", "stop", "length"]),  # one dropped
        make_group(rng, rewards=(0.5, 0.5)),  # zero variance: rejected, trains nothing
    ]
    publish(client, keys.traj, groups)
    archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
    while archiver.step(block=0.1):
        pass
    archiver.close()
    recs = _records(cfg)
    adv = [[c["advantage"] for c in r["completions"]] for r in recs]
    assert adv[0] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])  # rloo, as the trainer computes it
    assert adv[1][:2] == pytest.approx([1.0, -1.0]) and adv[1][2] is None  # rloo over the two kept
    assert adv[2] == [None, None] and recs[2]["verdict"] == "zero_variance"
    assert {(r["verdict_by"], r["verdict_version"]) for r in recs} == {("archiver", 0)}
    assert cli.main(["samples", *_args(cfg, "--last", "3")]) == 0
    out = capsys.readouterr().out
    assert "accepted (archiver at v0)" in out and "adv   none" in out


def test_samples_and_dead_on_a_run_that_does_not_exist_say_so_and_exit_2(redis_url, tmp_path, capsys):
    args = ["--run", "no-such-run", "--data-dir", str(tmp_path), "--redis-url", redis_url]
    assert cli.main(["samples", *args]) == 2
    assert cli.main(["dead", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no rollout archive" in err[0] and "no run 'no-such-run'" in err[1]


def test_dead_lists_reasons_and_replays_one(client, keys, redis_url, tmp_path, capsys):
    cfg = _cfg(keys, redis_url, tmp_path)
    raw = encode(make_group(random.Random(1)))
    letter = DeadLetter(
        stream=keys.traj, entry_id="1-0", raw=raw, reason="a reward bug", consumer="trainer/t"
    )
    dead_id = client.xadd(keys.dead, entry(letter)).decode()
    assert cli.main(["dead", *_args(cfg)]) == 0
    assert "a reward bug" in capsys.readouterr().out
    assert cli.main(["dead", *_args(cfg, "--replay", dead_id)]) == 0
    assert client.xrange(keys.traj)[-1][1][FIELD] == raw
    assert cli.main(["dead", *_args(cfg, "--replay", "9-9")]) == 2


def _group_line(n: int) -> str:
    """A group as the archiver writes it (consumers.archive.record), reduced to what `samples` prints."""
    completion = {"text": f"c{n}", "reward": 1.0, "advantage": 0.5, "version": 0, "finish_reason": "stop"}
    rec = {"id": f"{n}-0", "row": n, "producer": "p", "policy_version": 0, "verdict": "accepted"}
    return json.dumps({**rec, "published_at": 1.7e9, "prompt": f"prompt {n}", "completions": [completion]})


class _Follow:
    """`streamer samples --follow` in its own process; its output read on a thread, as it comes."""

    def __init__(self, cfg: RunConfig):
        argv = [sys.executable, "-m", "streamer", "samples", "--follow", "--last", "1"]
        self.proc = subprocess.Popen(
            [*argv, "--run", cfg.run.name, "--data-dir", cfg.run.data_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def __enter__(self) -> _Follow:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, group: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while f"== {group}-0 " not in "".join(self.out):
            try:
                self.out.append(self.lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                ended = (
                    ""
                    if self.proc.poll() is None
                    else f", exited {self.proc.returncode}: {self.proc.stderr.read()}"
                )
                pytest.fail(
                    f"no group {group} from `samples --follow` within {timeout} s{ended}; it printed:\n{''.join(self.out)}"
                )

    def interrupt(self) -> tuple[list[str], str]:
        """Ctrl-C: the ids of the groups it printed, and its stderr."""
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(20) == 0
        self.reader.join(10)
        while not self.lines.empty():
            self.out.append(self.lines.get())
        heads = [line.split()[1] for line in self.out if line.startswith("== ")]
        return heads, self.proc.stderr.read()


def test_a_follow_prints_each_group_appended_after_it_started_once_in_order(tmp_path):
    cfg = replace(RunConfig(), run={"name": "follow", "data_dir": str(tmp_path / "data")})
    directory = archive_dir(cfg)
    writer = RotatingWriter(directory, file_bytes=1 << 20, max_bytes=1 << 30)
    writer.write([_group_line(0), _group_line(1)])
    writer.close()
    with _Follow(cfg) as follow:
        follow.wait_for(1)
        with gzip.open(directory / "rollouts-000001.jsonl.gz", "ab") as f:  # a new gzip member
            f.write((_group_line(2) + "\n").encode())
        writer = RotatingWriter(directory, file_bytes=1 << 20, max_bytes=1 << 30)
        writer.write([_group_line(3)])  # a new file, its gzip member still being written
        follow.wait_for(3)
        writer.write([_group_line(4)])
        follow.wait_for(4)
        writer.close()
        RotatingWriter(directory, file_bytes=1, max_bytes=1 << 30).write([_group_line(5)])  # another file
        follow.wait_for(5)
        heads, err = follow.interrupt()
        assert heads == ["1-0", "2-0", "3-0", "4-0", "5-0"], err
        assert err == ""


def test_a_follow_reads_on_past_a_pruned_file_and_a_corrupt_one(tmp_path, capsys, caplog):
    cfg = replace(RunConfig(), run={"name": "follow", "data_dir": str(tmp_path / "data")})
    directory = archive_dir(cfg)

    def new_file(*groups: int) -> None:
        RotatingWriter(directory, file_bytes=1, max_bytes=1 << 30).write([_group_line(n) for n in groups])

    new_file(0)
    with _Follow(cfg) as follow:
        follow.wait_for(0)
        new_file(1, 2)
        (directory / "rollouts-000001.jsonl.gz").unlink()  # pruned, as the archiver prunes, while followed
        follow.wait_for(2)
        with open(directory / "rollouts-000002.jsonl.gz", "ab") as f:
            f.write(b"not gzip\n")
        new_file(3)
        follow.wait_for(3)
        heads, err = follow.interrupt()
        assert heads == ["0-0", "1-0", "2-0", "3-0"], err
        assert len(err.splitlines()) == 1, err
        assert "cannot read archive file rollouts-000002.jsonl.gz" in err and "skipping the rest of it" in err
    with open(directory / "rollouts-000003.jsonl.gz", "ab") as f:
        f.write(b"not gzip\n")
    assert cli.main(["samples", "--run", cfg.run.name, "--data-dir", cfg.run.data_dir, "--last", "9"]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("== ")] == [
        "1-0",
        "2-0",
        "3-0",
    ]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "cannot read archive file rollouts-000003.jsonl.gz",
        "cannot read archive file rollouts-000002.jsonl.gz",
    ]


def test_trimming_passes_an_archiver_that_lags_more_than_max_lag(client, keys):
    ids = publish(client, keys.traj, [make_group(random.Random(i)) for i in range(30)])
    client.xgroup_create(keys.traj, TRAINER_GROUP, id=ids[-1])  # the trainer has all 30
    client.xgroup_create(keys.traj, ARCHIVE_GROUP, id="0")  # the archiver has read nothing
    assert trim_acked(client, keys.traj) == 0  # without a bound it holds everything
    assert trim_acked(client, keys.traj, max_lag={ARCHIVE_GROUP: 10}) == 20
    assert client.xlen(keys.traj) == 10


def test_rotation_keeps_the_archive_under_max_bytes(tmp_path):
    w = RotatingWriter(tmp_path, file_bytes=2_000, max_bytes=10_000)
    rng = random.Random(0)
    for _ in range(200):
        w.write(["".join(rng.choice("abcdefgh") for _ in range(300))])
    w.close()
    files = sorted(tmp_path.glob("rollouts-*.jsonl.gz"))
    assert len(files) > 2 and sum(f.stat().st_size for f in files) <= 10_000 + 2_500


def _fill(path) -> None:
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@pytest.mark.parametrize("broken", ["unwritable", "full"])
def test_a_broken_archive_disk_stops_archiving_and_skips_without_holding_entries(
    broken, client, keys, redis_url, tmp_path, caplog
):
    data = tmp_path / "data"
    if broken == "full":
        data.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(data)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        cfg = _cfg(keys, redis_url, tmp_path)
        if broken == "unwritable":
            archive_dir(cfg).parent.mkdir(parents=True)
            archive_dir(cfg).write_text("a file where the directory should be")
        else:
            archive_dir(cfg).mkdir(parents=True)
            _fill(data / "filler")
        publish(client, keys.traj, [make_group(random.Random(i)) for i in range(40)])
        archiver = Archiver(cfg, client=client, tokenizer=demo.tokenizer())
        with caplog.at_level(logging.ERROR, logger="consumers.archive"):
            while archiver.step(block=0.1):
                pass
        lines = [r for r in caplog.records if "archiving stopped" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        assert archiver.archived + archiver.skipped == 40 and archiver.skipped > 0
        info = {g["name"].decode(): g for g in client.xinfo_groups(keys.traj)}
        assert info[ARCHIVE_GROUP]["pending"] == 0 and info[ARCHIVE_GROUP]["lag"] == 0
    finally:
        if broken == "full":
            subprocess.run(["umount", "-l", str(data)], check=False)


@pytest.mark.parametrize(
    "trainer",
    [
        {"advantage": "grpo"},
        {"advantage": "grpo", "std_normalize": False},
        {"advantage": "dr_grpo"},
        {"advantage": "rloo"},
        {"advantage": "consumers.advantages:rloo"},  # a user's function: through torch
    ],
)
def test_the_archived_advantages_are_the_trainers_without_torch(trainer):
    import torch

    cfg = replace(RunConfig(), trainer=trainer).trainer
    archived, trained = advantage_of(cfg), advantages.resolve(cfg)
    for rewards in [(1.0, 0.0, 0.0, 1.0), (0.5,), (2.0, 2.0, 2.0), (1e30, -1e30, 3.0), (0.1, 0.2, 0.25, 0.9)]:
        r = np.array(rewards, np.float32)
        ours = archived(r.astype(np.float64))
        theirs = advantages.compute(trained, torch.from_numpy(r)).numpy()
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7, err_msg=str(rewards))


def test_the_demo_decoder_decodes_as_the_demo_tokenizer():
    rng = random.Random(4)
    fast, plain = demo.tokenizer(), demo.decoder()
    for _ in range(200):
        ids = [rng.randrange(len(fast)) for _ in range(rng.randint(0, 12))]
        for skip in (False, True):
            assert plain.decode(ids, skip_special_tokens=skip) == fast.decode(
                ids, skip_special_tokens=skip
            ), ids
