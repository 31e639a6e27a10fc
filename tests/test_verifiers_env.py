"""A verifiers environment as the rollout (`producer.rollout = "verifiers:ENV_ID"`,
producers/envs/verifiers_rollout.py): scripted episodes check the rubric's reward and that the
trajectory is the proxy's record of the tokens sampled, single- and multi-turn; failures go
where they belong; `streamer up` trains both tiny environments of tests/verifiers_envs/."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path

import anyio
import pytest
from bounds import RUN
from contexts import Scripted, context, threaded
from needs import need
from runs import Up

from producers.components import load_rollout, load_task
from producers.dataset import load_rows
from producers.envs import verifiers_rollout
from producers.episodes import to_sample
from producers.proxy import server
from streamer import demo
from streamer.errors import ConfigError, EpisodeRejected, SamplerError

ENVS = Path(__file__).resolve().parent / "verifiers_envs"


@pytest.fixture(autouse=True)
def _environments(monkeypatch):
    need(importlib.util.find_spec("verifiers") is not None, "verifiers is not installed (the envs extra)")
    monkeypatch.syspath_prepend(str(ENVS))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ENVS), path) if p))


class Replies(Scripted):
    """A sampler answering each call with the next text of ``texts`` (then the last again)."""

    def __init__(self, renderer, *texts: str):
        super().__init__(renderer, texts[0])
        self.texts, self.calls = texts, 0

    def sample(self, prompt_ids, **kwargs):
        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        self.ids = [
            *self.renderer.tokenizer.encode(text, add_special_tokens=False),
            self.renderer.stop_ids[0],
        ]
        return super().sample(prompt_ids, **kwargs)


def _run(env_id: str, row: dict, sampler, **over):
    task = load_task(demo.config(), dataset="demo", rows=[row])
    ctx = context(task, threaded(sampler(task.renderer), version=3), **over)
    return anyio.run(load_rollout(f"verifiers:{env_id}"), row, ctx), task


def _row(env_id: str, answer: str) -> dict:
    return next(r for r in load_rows(f"verifiers:{env_id}") if r["answer"] == answer)


def test_rows_are_the_tasksets_tasks_with_their_prompt_as_a_chat():
    rows = load_rows("verifiers:vf_addition")
    assert len(rows) == len(demo.rows("train"))
    assert rows[0] == {
        "idx": 0,
        "prompt": "0+0=",
        "answer": "0",
        "messages": [{"role": "user", "content": "0+0="}],
    }
    assert load_rows("verifiers:vf_addition", split="eval") == rows, "a taskset has no held-out split"


def test_single_turn_rubric_scores_and_the_episode_is_the_tokens_sampled():
    row = _row("vf_addition", "7")
    for reply, reward in (("7", 1.0), ("5", 0.0)):
        episodes, task = _run("vf_addition", row, lambda r, reply=reply: Scripted(r, reply), group_size=3)
        assert [e.reward for e in episodes] == [reward] * 3
        ids = [*task.renderer.tokenizer.encode(reply, add_special_tokens=False), task.renderer.stop_ids[0]]
        for e in episodes:
            prompt, sampled = e.segments
            assert prompt.tokens == task.renderer.render(row) and not prompt.sampled
            assert sampled.tokens == ids and sampled.version == 3 and sampled.logprobs == [-0.5] * len(ids)
            assert e.metrics["turns"] == 1 and e.metrics["proxy_divergences"] == 0
    assert not server().sessions, "every episode's key is gone once it ends"
    assert not [k for k in os.environ if k.startswith(verifiers_rollout.KEY_VARIABLE)]


def test_multi_turn_env_feedback_is_context_and_the_rubric_pays_the_attempt():
    row = _row("vf_retry", "7")
    (ep,), task = _run("vf_retry", row, lambda r: Replies(r, "3", "9", "7"))
    assert ep.reward == 0.3 and ep.metrics["turns"] == 3 and ep.metrics["proxy_divergences"] == 0
    text = task.renderer.tokenizer.decode(ep.tokens)
    assert text.endswith("3<|end|><|user|>+<|end|><|assistant|>9<|end|><|user|>=<|end|><|assistant|>7<|end|>")
    sample = to_sample(ep, vocab_size=len(task.renderer.tokenizer))
    assert len(sample.spans) == 3 and sample.loss_mask().sum() == 6, "only the three sampled replies train"
    (ep,), _ = _run("vf_retry", row, lambda r: Replies(r, "1", "7"))
    assert ep.reward == 0.6 and ep.metrics["turns"] == 2, "the env stops at a right reply"


def test_an_engine_samples_the_episode_through_the_remote_sampler():
    from producers.fake_server import FakeCompletionsServer, canned
    from producers.remote_sampler import RemoteSampler

    row = _row("vf_retry", "7")
    task = load_task(demo.config(), dataset="demo", rows=[row])
    ids = [*task.renderer.tokenizer.encode("7", add_special_tokens=False), task.renderer.stop_ids[0]]
    with FakeCompletionsServer(canned(ids, logprob=-0.25)) as server:
        remote = RemoteSampler(base_url=server.url, model="demo", stop_ids=task.renderer.stop_ids)
        ctx = context(task, threaded(remote, version=2), group_size=2)
        episodes = anyio.run(load_rollout("verifiers:vf_retry"), row, ctx)
        remote.close()
    assert [e.reward for e in episodes] == [1.0, 1.0]
    assert [b["prompt"] for b in server.bodies] == [task.renderer.render(row)] * 2, (
        "the engine got the tokens"
    )
    (sampled,) = [s for s in episodes[0].segments if s.sampled]
    assert sampled.tokens == ids and sampled.logprobs == [-0.25] * len(ids) and sampled.version == 2


def test_rows_of_another_dataset_are_read_as_the_tasks_data():
    row = demo.rows("train")[4]  # {"messages": [...], "answer": ...}: no `prompt`
    episodes, _ = _run("vf_addition", row, lambda r: Scripted(r, row["answer"]))
    assert [e.reward for e in episodes] == [1.0]


def test_an_episode_verifiers_marks_failed_is_dropped_with_the_reason(caplog):
    row = _row("vf_addition", "7")
    with caplog.at_level(logging.WARNING, logger=verifiers_rollout.__name__):
        episodes, _ = _run("vf_addition", row, lambda r: Scripted(r, "7"), max_seq_len=4, group_size=2)
    assert episodes == []  # the proxy refused the call (no room): the harness failed, so did each episode
    assert caplog.text.count("failed (dropped)") == 2 and "no room under max_seq_len 4" in caplog.text


def test_an_engine_failure_reaches_the_producer_as_an_outage():
    class Down(Scripted):
        def sample(self, *args, **kwargs):
            raise SamplerError("server gone")

    with pytest.raises(BaseExceptionGroup) as group:
        _run("vf_addition", _row("vf_addition", "7"), Down)
    assert isinstance(group.value.exceptions[0], SamplerError)


def test_a_seat_verifiers_does_not_train_is_refused():
    with pytest.raises(BaseExceptionGroup) as group:
        _run("vf_untrained", _row("vf_addition", "7"), lambda r: Scripted(r, "7"))
    (refused,) = {type(e): e for e in group.value.exceptions}.values()
    assert isinstance(refused, EpisodeRejected) and "does not train seat(s) agent" in str(refused)


def test_a_bad_environment_or_a_missing_package_is_one_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="verifiers:no_such_env: ModuleNotFoundError"):
        load_rollout("verifiers:no_such_env")
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    verifiers_rollout.environment.cache_clear()
    with pytest.raises(
        ConfigError, match=re.escape("needs the verifiers package") + ".*streamer-rl\\[envs\\]"
    ):
        load_rollout("verifiers:vf_addition")
    verifiers_rollout.environment.cache_clear()


# ---------------------------------------------------------------- streamer up


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["vf_addition", "vf_retry"])
def test_up_trains_a_verifiers_environment(tmp_path, env_id):
    steps = 3
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nname = "{env_id.replace("_", "-")}"\n'
        f'[producer]\ndataset = "verifiers:{env_id}"\nrollout = "verifiers:{env_id}"\n'
        'group_size = 8\nmax_new_tokens = 2\n[trainer]\ngroups_per_step = 2\nmax_seq_len = 64\noverlong = "keep"\n'
        f'[eval]\ndataset = "verifiers:{env_id}"\nmax_rows = 5\nmax_new_tokens = 2\n'
    )
    with Up(tmp_path, "--fresh", "--steps", str(steps), "--config", str(config)) as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0 and f"steps trained      {steps}" in out, out
    run_dir = tmp_path / env_id.replace("_", "-")
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "failed (dropped)" not in logs and " ERROR " not in logs, logs[-3000:]
    archive = sorted((run_dir / "archive").glob("*.jsonl.gz"))
    groups = [json.loads(x) for f in archive for x in gzip.decompress(f.read_bytes()).splitlines()]
    rewards = {c["reward"] for g in groups for c in g["completions"]}
    assert groups and rewards <= {0.0, 0.3, 0.6, 1.0}, rewards  # the rubrics' values
    if env_id == "vf_addition":  # one turn: the archived text is what the rubric read
        for g in groups:
            answer = str(sum(map(int, re.search(r"(\d)\+(\d)=", g["prompt"]).groups())))
            for c in g["completions"]:
                text = re.sub(r"<[^>]*>", "", c["text"]).strip()
                assert c["reward"] == float(text[:1] == answer), (g["prompt"], c)
    curve = json.loads((run_dir / "curve.json").read_text())
    assert curve["eval_accuracy_by_version"], "the evaluator scored no version with the environment"
