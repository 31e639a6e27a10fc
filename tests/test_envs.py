"""Environments from other libraries (producers/envs): math-verify grading
(`producer.reward = "math"`), reasoning-gym rows and scoring (`reasoning_gym:NAME`), a missing
package as one config error naming the extra, and `streamer up` running each to the end."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import re
import sys
import threading

import pytest
from bounds import RUN
from needs import need
from runs import Up

from producers import envs, eval_sets, rewards
from producers.components import load_reward
from producers.dataset import load_rows
from producers.envs import gym_tasks, math_reward
from streamer import demo
from streamer.config import RunConfig
from streamer.errors import ConfigError
from streamer.rollout import tasks


@pytest.fixture(autouse=True)
def _installed():
    for module, package in (("math_verify", "math-verify"), ("reasoning_gym", "reasoning-gym")):
        need(importlib.util.find_spec(module) is not None, f"{package} is not installed (the envs extra)")


# ---------------------------------------------------------------- math-verify


@pytest.mark.parametrize(
    "answer, text, reward",
    [
        ("0.5", "\\boxed{1/2}", 1.0),
        ("0.5", "so it is $\\frac{1}{2}$.", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("1+2x", "2x+1", 1.0),
        ("1+2x", "The answer is \\boxed{2x + 1}", 1.0),
        ("x^2", "\\boxed{x \\cdot x}", 1.0),
        ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
        ("Natalia sold 48 clips in April.\n#### 72", "72", 1.0),
        ("72", "The answer is 71, not 72.", 0.0),
        ("1/3", "0.333", 0.0),
        ("1+2x", "2x+2", 0.0),
    ],
)
def test_math_grades_equal_answers_in_any_form(answer, text, reward):
    assert math_reward.math_verified({"answer": answer}, text) == reward


@pytest.mark.parametrize("text", ["", "no answer at all", "))(( \\boxed{", "\\frac{", "$$$", "\x00" * 50])
def test_math_scores_a_completion_it_cannot_read_0(text):
    assert math_reward.math_verified({"answer": "3"}, text) == 0.0


def test_math_drops_a_sample_whose_reference_cannot_be_read():
    with pytest.raises(ValueError, match="reference answer"):
        math_reward.math_verified({"answer": ""}, "3")  # the producer drops the sample, logged
    assert math_reward.math_verified.required_fields == ("answer",)


def test_math_grading_past_its_bound_is_0_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(math_reward, "TIMEOUT_SECONDS", 1)
    with caplog.at_level(logging.WARNING, logger=math_reward.__name__):
        assert math_reward.math_verified({"answer": "1"}, "\\boxed{9^{9^{9^{9}}}}") == 0.0
    assert "ran past 1s (0.0)" in caplog.text


def test_math_grades_off_the_main_thread_unbounded():
    out = []
    worker = threading.Thread(target=lambda: out.append(math_reward.math_verified({"answer": "0.5"}, "1/2")))
    worker.start()
    worker.join(60)
    assert out == [1.0]


def test_reward_names_load_through_the_config():
    cfg = RunConfig()
    assert load_reward(cfg, "math") is math_reward.math_verified
    assert load_reward(cfg, "reasoning_gym") is gym_tasks.reasoning_gym_score
    assert rewards.default_path("", "reasoning_gym:basic_arithmetic") == "reasoning_gym"
    assert rewards.default_path("math", "reasoning_gym:basic_arithmetic") == "math"


@pytest.mark.parametrize(
    "module, how",
    [
        ("math_verify", lambda: load_reward(RunConfig(), "math")),
        ("reasoning_gym", lambda: load_reward(RunConfig(), "reasoning_gym")),
        ("reasoning_gym", lambda: load_rows("reasoning_gym:leg_counting_not_cached")),
    ],
)
def test_a_missing_package_is_one_config_error_naming_the_extra(monkeypatch, module, how):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    with pytest.raises(ConfigError, match=re.escape("pip install 'streamer-rl[envs]'")):
        how()


# ---------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_rows_are_seeded_and_the_eval_split_is_held_out():
    train, held = (
        load_rows("reasoning_gym:basic_arithmetic"),
        load_rows("reasoning_gym:basic_arithmetic", split="eval"),
    )
    assert train == gym_tasks.rows("basic_arithmetic"), "the same rows on every call (every machine)"
    assert len(held) == gym_tasks.EVAL_ROWS and 0 < len(train) <= gym_tasks.TRAIN_ROWS
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    row = train[0]
    assert row["messages"] == [{"role": "user", "content": row["question"]}]
    assert row["metadata"]["source_dataset"] == "basic_arithmetic"
    # a small task space repeats questions across seeds: those are dropped from train
    small = gym_tasks.rows("leg_counting")
    assert not {r["question"] for r in small} & {
        r["question"] for r in gym_tasks.rows("leg_counting", "eval")
    }


def test_reasoning_gym_scores_with_the_tasks_own_score_answer(monkeypatch, caplog):
    row = gym_tasks.rows("basic_arithmetic")[3]
    score = gym_tasks.load_reward()
    assert score(row, row["answer"]) == 1.0
    assert score(row, f"first I add.\n<answer>{row['answer']}</answer>") == 1.0
    assert score(row, f"<answer>{row['answer']}1</answer>") < 1.0
    assert score(row, "no idea") == 0.0

    class Broken:
        def score_answer(self, answer, entry):
            raise KeyError("metadata")

    monkeypatch.setattr(gym_tasks, "_dataset", lambda name: Broken())
    with caplog.at_level(logging.WARNING, logger=gym_tasks.__name__):
        assert score(row, "7") == 0.0
    assert "score_answer raised KeyError" in caplog.text


def test_an_unknown_reasoning_gym_task_is_a_config_error_with_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean basic_arithmetic"):
        load_rows("reasoning_gym:basic_arith")
    cfg = tasks.config("reasoning_gym:no_such_task")  # its rows are read before anything starts
    with pytest.raises(ConfigError, match="no task"):
        eval_sets.prepare(cfg)


def test_task_reasoning_gym_runs_the_task_on_the_demo_model():
    cfg = tasks.config("reasoning_gym:basic_arithmetic")
    assert cfg.producer.dataset == cfg.eval.dataset == "reasoning_gym:basic_arithmetic"
    assert cfg.model.name_or_path == demo.config().model.name_or_path
    assert rewards.default_path(cfg.producer.reward, cfg.producer.dataset) == "reasoning_gym"
    assert envs.is_source(cfg.producer.dataset) and not envs.is_source("data/train.jsonl")


# ---------------------------------------------------------------- streamer up


def _archived(run_dir) -> list[dict]:
    """Every group the archiver wrote."""
    files = sorted((run_dir / "archive").glob("*.jsonl.gz"))
    return [json.loads(line) for f in files for line in gzip.decompress(f.read_bytes()).splitlines()]


def _up(tmp_path, steps: int, *args: str) -> str:
    with Up(tmp_path, "--fresh", "--steps", str(steps), *args) as up:
        code = up.proc.wait(timeout=RUN)
    out = up.output()
    assert code == 0, out
    assert f"steps trained      {steps}" in out, out
    return out


@pytest.mark.slow
def test_up_trains_the_demo_rows_graded_by_math_verify(tmp_path):
    config = tmp_path / "math.toml"
    config.write_text(
        '[producer]\nreward = "math"\ngroup_size = 8\nmax_new_tokens = 2\n'
        '[trainer]\ngroups_per_step = 2\noverlong = "keep"\n[eval]\nmax_rows = 5\n'
    )
    _up(tmp_path, 3, "--config", str(config))
    groups = _archived(tmp_path / "demo")
    scored = [(g["prompt"], c) for g in groups for c in g["completions"]]
    assert scored, "nothing archived"
    for prompt, c in scored:  # the reward the trainer got is math-verify's grade of the text
        a, b = map(int, re.search(r"(\d)\+(\d)=", prompt).groups())
        text = re.sub(r"<[^>]*>", "", c["text"])  # the reward reads the text without specials
        assert c["reward"] == math_reward.math_verified({"answer": str(a + b)}, text), (prompt, c)


@pytest.mark.slow
def test_up_task_reasoning_gym_scores_with_score_answer_and_trains(tmp_path):
    _up(tmp_path, 4, "--task", "reasoning_gym:basic_arithmetic")
    run_dir = tmp_path / "reasoning-gym-basic-arithmetic"
    train = gym_tasks.rows("basic_arithmetic")
    groups = _archived(run_dir)
    assert groups, "nothing archived"
    for g in groups:
        row = train[g["row"]]
        for c in g["completions"]:
            text = re.sub(r"<[^>]*>", "", c["text"])
            assert c["reward"] == gym_tasks.reasoning_gym_score(row, text), (row["question"], c)
    curve = json.loads((run_dir / "curve.json").read_text())
    assert curve["eval_accuracy_by_version"], "the evaluator scored no version on the eval split"
