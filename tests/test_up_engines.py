"""`streamer up` the way a user runs a real model: half-precision weights, and a vLLM server
that `up` starts, feeds every version and stops with the rest."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from bounds import RUN, START
from needs import need
from runs import Up

from streamer import tensorfile, vllm_server, weights

pytestmark = pytest.mark.slow


def _engine_processes(model_dir: Path) -> list[int]:
    """PIDs whose command line names ``model_dir`` (the engine and its workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(model_dir) in cmdline:
                pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_up_trains_in_half_precision_with_producers_on_the_new_versions(tmp_path, dtype):
    steps = 12
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\ndtype = "{dtype}"\n[trainer]\ncheckpoint_every = 5\n')
    with Up(tmp_path / "data", "--config", str(config), "--steps", str(steps)) as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0 and f"steps trained      {steps}" in out, out
    run = tmp_path / "data" / "demo"
    head, _ = tensorfile.header(weights.version_dir(run / "weights", steps) / weights.WEIGHTS_FILE)
    assert {s["dtype"] for s in head.values()} == {"BF16" if dtype == "bfloat16" else "F16"}
    logs = {p.name: p.read_text() for p in (run / "logs").glob("produce-*.log")}
    assert all("cannot load" not in text for text in logs.values()), logs
    curve = json.loads((run / "curve.json").read_text())
    sampled = sorted(int(v) for v in curve["reward_by_version"])
    assert sampled[-1] >= steps - 4, f"producers stayed on old versions: {sampled}"


def _shared_system_prompt_run(tmp_path: Path) -> Path:
    """A run config on demo rows whose prompts share a system prompt longer than one 32-token
    KV block, eight rows in flight, versions loaded with requests kept in flight, and half the
    groups audited under their stamped versions."""
    system = "0123456789" * 3 + "9876"  # 34 tokens: with its role tokens, past one block
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"{a}+{b}="},
                    ],
                    "answer": str(a + b),
                }
            )
            + "\n"
            for a in range(10)
            for b in range(10)
            if a + b <= 9
        )
    )
    config = tmp_path / "run.toml"
    config.write_text(
        f'[producer]\ndataset = "{rows}"\nreward = "streamer.demo:reward"\nconcurrency = 8\n'
        'max_new_tokens = 8\ninflight_updates = "keep"\n[trainer]\naudit_fraction = 0.5\n'
    )
    return config


def test_up_engine_vllm_feeds_every_version_with_requests_in_flight_and_stops_it(tmp_path):
    """`up --engine vllm` starts the server, feeds it every version while eight rows are in
    flight on prompts sharing a system prompt, and stops it on Ctrl-C: the trainer's audit
    finds every audited token's log-prob that of the version it is stamped with."""
    need(vllm_server.python() is not None, "no vLLM virtualenv (python3 dev.py vllm)")
    config = _shared_system_prompt_run(tmp_path)
    data = tmp_path / "data"
    model_dir = (data / "demo" / "engine-model").resolve()
    with Up(data, "--engine", "vllm", "--config", str(config), "--steps", "1000") as up:
        deadline = time.monotonic() + START + RUN
        while (
            not (versions := [int(v) for v in re.findall(r"version\s+(\d+)", up.output())])
            or max(versions) < 12
        ):
            assert up.proc.poll() is None, up.output()
            assert time.monotonic() < deadline, f"no version 12 in time:\n{up.output()[-3000:]}"
            time.sleep(1.0)
        assert _engine_processes(model_dir), "the engine is not running"
        up.proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = up.proc.wait(timeout=START)
    out = up.output()
    assert code == 130, out
    assert "stopping (producers, evaluator, engine, trainer," in out, out
    assert not _engine_processes(model_dir), "an engine process outlived up"
    logs = data / "demo" / "logs"
    engine_log = (logs / "engine.log").read_text()
    assert engine_log.count("POST /collective_rpc") >= 5, engine_log[-3000:]
    assert "/pause?mode=keep" in engine_log and "reset_running_requests=true" in engine_log
    train = (logs / "train.log").read_text()
    assert "version stamps look wrong" not in train, train[-3000:]
    audited = re.findall(r"version stamps audited over the run: ([\d,]+) tokens .*max gap (\S+) nats", train)
    assert audited, f"the audit never reported:\n{train[-3000:]}"
    assert int(audited[0][0].replace(",", "")) > 100 and float(audited[0][1]) < 1e-3, audited
    curve = json.loads((data / "demo" / "curve.json").read_text())
    sampled = sorted(int(v) for v in curve["reward_by_version"])
    assert sampled and sampled[-1] >= 4, f"producers stayed on old versions: {sampled}"
    config = json.loads((model_dir / "config.json").read_text())
    assert (
        config["tie_word_embeddings"] is False
        and config["hidden_size"] // config["num_attention_heads"] == 64
    )
