"""The multi-turn tasks (streamer/rollout/tasks.py): scripted episodes check their trajectories
(tool results and feedback at weight 0, per-turn versions), and `streamer up --task tools`
for a short run shows reward rising."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from contexts import context

from producers.components import load_task
from producers.episodes import to_sample
from streamer import demo
from streamer.rollout import tasks
from streamer.rollout.contract import Completion, RolloutContext

ROOT = Path(__file__).resolve().parents[1]


def _ctx(name: str, replies: list[str], group_size: int = 1) -> RolloutContext:
    tok = demo.tokenizer()
    cfg = tasks.config(name)
    task = load_task(cfg, dataset=cfg.producer.dataset, tokenizer=tok)
    script = iter(replies)

    async def sample(prompt, *, n, **_):
        ids = tok.encode(next(script), add_special_tokens=False) + [tok.eos_token_id]
        return [Completion(ids, [-0.5] * len(ids), "stop", version=len(prompt))]

    return context(task, sample, group_size=group_size, max_new_tokens=2, seed=0)


def test_the_tool_result_is_in_the_context_with_weight_0():
    row = tasks.rows("tools")[7]
    v = str(tasks.value(row["key"], table=0))  # episode 0 of a group with seed 0: table 0
    (ep,) = anyio.run(tasks.tools, row, _ctx("tools", ["=", v]))
    assert ep.reward == 1.0
    assert ep.metrics == {"tool_calls": 1.0, "turns": 2.0, "success": 1.0}
    tok = demo.tokenizer()
    tool = [s for s in ep.segments[1:] if not s.sampled]
    assert tok.decode(tool[0].tokens) == f"<|system|>{v}<|end|><|assistant|>"
    sample = to_sample(ep, vocab_size=len(tok))
    completion = sample.completion_ids().tolist()
    start = completion.index(tok.convert_tokens_to_ids("<|system|>"))
    assert sample.loss_mask()[start : start + len(tool[0].tokens)].sum() == 0, "tool tokens are trained"
    assert sample.loss_mask().sum() == 4  # "=" EOS and the digit EOS: only what the model sampled
    (wrong,) = anyio.run(tasks.tools, row, _ctx("tools", [v]))  # no call: a guess
    assert wrong.metrics["tool_calls"] == 0 and wrong.reward == 0.0, "an answer without a lookup"
    other = {tasks.value(row["key"], table=t) for t in range(50)}
    assert len(other) > 5, "each episode draws its own table: nothing to memorise"


def test_retry_feedback_says_higher_or_lower_and_later_attempts_earn_less():
    row = next(r for r in tasks.rows("retry") if r["answer"] == "5")
    (ep,) = anyio.run(tasks.retry, row, _ctx("retry", ["2", "7", "5"]))
    assert ep.reward == tasks.RETRY_REWARDS[2] and ep.metrics["turns"] == 3.0
    text = demo.tokenizer().decode(ep.tokens)
    assert "2<|end|><|user|>+<|end|><|assistant|>7<|end|><|user|>=<|end|><|assistant|>5" in text
    sample = to_sample(ep, vocab_size=len(demo.tokenizer()))
    assert len(sample.spans) == 3 and sample.loss_mask().sum() == 6


def test_held_out_rows_are_not_in_the_train_split():
    for name in tasks.TASKS:
        train = {json.dumps(r, sort_keys=True) for r in tasks.rows(name)}
        held = {json.dumps(r, sort_keys=True) for r in tasks.rows(name, "eval")}
        assert train and held and not train & held


@pytest.mark.slow
def test_up_task_tools_reward_rises(tmp_path):
    steps = 120
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "streamer", "up", "--task", "tools", "--fresh", "--no-progress"]
    proc = subprocess.run(
        [*cmd, "--data-dir", str(tmp_path), "--steps", str(steps)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curve = json.loads((tmp_path / "tools" / "curve.json").read_text())
    rewards = {int(v): r for v, r in curve["reward_by_version"].items()}
    early = [r for v, r in rewards.items() if v < 15]
    late = [r for v, r in rewards.items() if v >= steps - 20]
    assert sum(late) / len(late) > sum(early) / len(early) + 0.1, rewards
