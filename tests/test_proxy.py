"""Black-box agents through the producer's OpenAI-compatible proxy (producers/proxy.py), driven
by the real OpenAI client: calls that extend a chain, re-tokenize it (a counted divergence)
or start a new conversation; streamed calls and calls for n choices, each choice a chain
that is trained; a whole producer step with an agent; garbage requests get a 4xx with a
reason and the proxy keeps serving."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest
from contexts import Scripted, context, threaded

from producers.components import load_task
from producers.openai_chat import MAX_CHOICES
from producers.producer import Producer
from producers.proxy import Endpoint, proxied, server
from schemas import MetricsEvent, TrajectoryGroup, decode
from streamer import demo
from streamer.config import RunConfig, replace
from streamer.rollout.contract import Completion, RolloutContext

ROW = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}


def _task():
    return load_task(demo.config(), dataset="demo", rows=[ROW])


def _ctx(task, sampler, **over) -> RolloutContext:
    """``sampler`` as a producer calls it, its completions stamped with version 3."""
    return context(task, threaded(sampler, version=3), **over)


def _client(endpoint: Endpoint) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def _chat(endpoint: Endpoint, messages: list[dict]) -> str:
    async with _client(endpoint) as client:
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
    return reply.choices[0].message.content


def test_an_agent_that_resends_the_history_extends_one_chain_and_only_its_samples_train():
    task = _task()
    sampler = Scripted(task.renderer, "5")

    @proxied
    async def agent(row, endpoint):
        history = list(row["messages"])
        first = await _chat(endpoint, history)
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": "+"}]
        second = await _chat(endpoint, history)
        return float(second == row["answer"])

    (ep,) = anyio.run(agent, ROW, _ctx(task, sampler))
    r = task.renderer
    assert ep.reward == 1.0 and ep.metrics["turns"] == 2 and ep.metrics["proxy_divergences"] == 0
    assert ep.tokens == sampler.prompts[1] + sampler.ids, "the trajectory is the last call's prompt + sample"
    sampled = [s for s in ep.segments if s.sampled]
    assert [s.tokens for s in sampled] == [sampler.ids, sampler.ids] and {s.version for s in sampled} == {3}
    feedback = r.render_suffix([{"role": "user", "content": "+"}])
    assert [s.tokens for s in ep.segments if not s.sampled] == [r.render(ROW), feedback], "context: weight 0"


def test_an_edited_history_is_a_counted_divergence_and_a_new_conversation_is_not():
    task = _task()
    sampler = Scripted(task.renderer, "5")

    @proxied
    async def edits(row, endpoint):
        await _chat(endpoint, row["messages"])
        edited = [*row["messages"], {"role": "assistant", "content": "55"}, {"role": "user", "content": "+"}]
        await _chat(endpoint, edited)  # not what the model sampled: its tokens differ
        return 1.0

    (ep,) = anyio.run(edits, ROW, _ctx(task, sampler))
    assert ep.metrics["proxy_divergences"] == 1 and ep.metrics["proxy_calls"] == 2
    assert ep.metrics["turns"] == 2 and ep.tokens == sampler.prompts[1] + sampler.ids, "the last chain"
    assert [[s.tokens for s in f] for f in ep.forks] == [[sampler.prompts[0], sampler.ids]], "and the first"

    @proxied
    async def restarts(row, endpoint):
        await _chat(endpoint, row["messages"])
        await _chat(endpoint, [{"role": "system", "content": "1"}, *row["messages"]])  # a new conversation
        return 1.0

    (ep,) = anyio.run(restarts, ROW, _ctx(task, sampler))
    assert ep.metrics["proxy_divergences"] == 0 and ep.metrics["turns"] == 2 and len(ep.forks) == 1


class Choices(Scripted):
    """A sampler whose i-th completion of any prompt is ``texts[i]`` (+ the stop token)."""

    def __init__(self, renderer, texts: list[str]):
        super().__init__(renderer)
        self.choices = [
            [*renderer.tokenizer.encode(t, add_special_tokens=False), renderer.stop_ids[0]] for t in texts
        ]
        self.asked: list[int] = []  # n of each engine call

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        self.prompts.append(list(prompt_ids))
        self.asked.append(n)
        out = [self.choices[i % len(self.choices)][:max_new_tokens] for i in range(n)]
        return [Completion(ids, [-0.5] * len(ids), "stop") for ids in out]


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_a_streamed_call_is_chunks_the_openai_client_reads_and_is_recorded_as_a_call():
    task = _task()
    sampler = Choices(task.renderer, ["5"])
    seen: dict = {}

    @proxied
    async def agent(row, endpoint):
        async with _client(endpoint) as client:
            stream = await client.chat.completions.create(
                model=endpoint.model,
                messages=row["messages"],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        seen["chunks"] = chunks
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return float(text == row["answer"])

    (ep,) = anyio.run(agent, ROW, _ctx(task, sampler))
    chunks = seen["chunks"]
    assert ep.reward == 1.0 and ep.metrics["turns"] == 1 and ep.metrics["proxy_calls"] == 1
    assert ep.tokens == sampler.prompts[0] + sampler.choices[0], "the call is recorded as a plain one is"
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, "stop"]
    *_, usage = chunks
    assert usage.choices == [] and usage.usage.prompt_tokens == len(sampler.prompts[0])
    assert usage.usage.completion_tokens == len(sampler.choices[0])


class Spelled:
    """The demo renderer, whose every completion decodes to ``text`` (a tool call: more than
    the demo's digits can spell)."""

    def __init__(self, renderer, text: str):
        self.renderer, self.text = renderer, text

    def __getattr__(self, name):
        return getattr(self.renderer, name)

    def decode(self, ids) -> str:
        return self.text


def test_a_streamed_tool_call_comes_back_as_tool_call_deltas_the_client_assembles():
    import dataclasses

    task = _task()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    task = dataclasses.replace(task, renderer=Spelled(task.renderer, "Adding. " + call))
    sampler = Choices(task.renderer, ["5"])
    seen: dict = {}

    @proxied
    async def agent(row, endpoint):
        from openai.lib.streaming.chat import ChatCompletionStreamState

        state = ChatCompletionStreamState()  # the client's own assembly of the deltas
        async with _client(endpoint) as client:
            chunks = await client.chat.completions.create(
                model=endpoint.model, messages=row["messages"], tools=TOOLS, stream=True
            )
            async for chunk in chunks:
                state.handle_chunk(chunk)
        seen["reply"] = state.get_final_completion()
        return 1.0

    (ep,) = anyio.run(agent, ROW, _ctx(task, sampler))
    (choice,) = seen["reply"].choices
    (tool,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding. "
    assert tool.function.name == "add" and json.loads(tool.function.arguments) == {"a": 2}
    assert ep.tokens == sampler.prompts[0] + sampler.choices[0], "recorded as sampled, not as decoded"


def test_n_choices_are_each_a_chain_the_one_continued_is_the_episode_and_every_one_is_trained():
    from producers.episodes import to_samples

    task = _task()
    sampler = Choices(task.renderer, ["4", "5", "6"])
    seen: dict = {}

    @proxied
    async def agent(row, endpoint):
        async with _client(endpoint) as client:
            first = await client.chat.completions.create(model=endpoint.model, messages=row["messages"], n=3)
            kept = next(c.message.content for c in first.choices if c.message.content == row["answer"])
            history = [
                *row["messages"],
                {"role": "assistant", "content": kept},
                {"role": "user", "content": "+"},
            ]
            second = await client.chat.completions.create(
                model=endpoint.model, messages=history, stream=True, n=2
            )
            chunks = [chunk async for chunk in second]
        seen["first"], seen["chunks"] = first, chunks
        return 1.0

    (ep,) = anyio.run(agent, ROW, _ctx(task, sampler))
    first, chunks = seen["first"], seen["chunks"]
    assert [c.message.content for c in first.choices] == ["4", "5", "6"]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.finish_reason for c in first.choices] == ["stop"] * 3
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "stop"] * 2
    assert first.usage.completion_tokens == sum(len(ids) for ids in sampler.choices)
    streamed = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        for i in (0, 1)
    }
    assert streamed == {0: "4", 1: "5"} and sampler.asked == [3, 2], (
        "one engine call per call, n choices each"
    )

    r, (prompt, second) = task.renderer, sampler.prompts
    four, five, six = sampler.choices
    assert ep.metrics["proxy_calls"] == 2 and ep.metrics["proxy_divergences"] == 0, (
        "siblings are no divergence"
    )
    assert ep.tokens == second + four, "the last call's first choice is the episode's last piece"
    assert second == prompt + five + r.render_suffix([{"role": "user", "content": "+"}]), (
        "the kept choice goes on"
    )
    pieces = [[s.tokens for s in f] for f in ep.forks]
    assert pieces == [[prompt, four], [prompt, six], [second, five]], "the choices not gone on with"
    samples = to_samples(ep, vocab_size=len(r.tokenizer))
    trained = [s.completion_ids()[s.loss_mask() > 0].tolist() for s in samples]
    assert trained == [four, six, five, five + four], "each choice is trained once, in its own chain"
    assert {s.episode for s in samples} == {0} and {s.reward for s in samples} == {1.0}, (
        "with the episode's reward"
    )


def _groups(client, keys) -> list[TrajectoryGroup]:
    return [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]


def test_a_producer_runs_g_agents_at_once_each_with_its_own_key(keys, redis_url, tmp_path, client):
    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 3, "min_group_size": 3, "max_new_tokens": 4},
        trainer={"groups_per_step": 1000},
    )
    task = _task()
    seen: set[str] = set()

    @proxied
    async def agent(row, endpoint):
        seen.add(endpoint.api_key)
        history = list(row["messages"])
        for _ in range(2):
            history.append({"role": "assistant", "content": await _chat(endpoint, history)})
            history.append({"role": "user", "content": "="})
        return float(len(seen))

    sampler = Scripted(task.renderer, "7")
    p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler, rollout=agent)
    assert p.step() == "published"
    (g,) = _groups(client, keys)
    assert len(seen) == 3 and len(g.samples) == 3 and g.policy_version == 0
    for s in g.samples:
        assert len(s.spans) == 2 and s.loss_mask().sum() == 2 * len(sampler.ids)
    (event,) = [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]
    assert event.values["turns_mean"] == 2 and event.values["proxy_divergences"] == 0
    assert not server().sessions, "every episode's key is gone once it ends"


def test_an_agent_that_streams_n_choices_is_sampled_by_the_model_and_trained_by_a_trainer(
    keys, redis_url, tmp_path, client
):
    """End to end in one process: a producer with the demo model (LocalSampler, batched
    engine calls), agents that stream a call for two choices, the group published, and a
    trainer step that trains every choice with its episode's advantage."""
    import threading

    from consumers import trainer
    from consumers.batch import collate
    from consumers.learner import Learner
    from producers.components import build
    from streamer.bus import entry_event

    cfg = replace(
        demo.config(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 2, "min_group_size": 2, "torch_threads": 1},
        trainer={"groups_per_step": 1, "steps": 1},
    )
    task, sampler = build(cfg)
    order = iter(range(2))

    @proxied
    async def agent(row, endpoint):
        me = next(order)
        async with _client(endpoint) as client:
            stream = await client.chat.completions.create(
                model=endpoint.model, messages=row["messages"], n=2, stream=True
            )
            finished = [c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason]
        assert len(finished) == 2, finished
        return float(me)  # one episode right, one wrong: the group teaches

    p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler, rollout=agent)
    assert p.step() == "published"
    (g,) = _groups(client, keys)
    assert [s.episode for s in g.samples] == [0, 0, 1, 1] and sorted(g.episode_rewards()) == [0.0, 1.0]
    prompts = {tuple(s.token_ids()[: s.prompt_len].tolist()) for s in g.samples}
    assert len(prompts) == 1, "each choice is its own chain from the row's prompt"
    assert all(s.loss_mask().sum() == len(s.completion_ids()) > 0 for s in g.samples), "every choice trains"
    adv = collate([g]).advantages.tolist()
    assert adv[0] == adv[1] == -adv[2] == -adv[3] != 0, "one advantage per episode, shared by its choices"

    learner = Learner(demo.build_model(cfg.run.seed), cfg.trainer)
    assert trainer.Trainer(cfg, client, keys, learner, stop=threading.Event()).run() == 0
    steps = [entry_event(f, MetricsEvent) for _, f in client.xrange(keys.metrics)]
    (step,) = [e for e in steps if e.source == "trainer"]
    lengths = [len(s.completion_ids()) for s in g.samples]
    assert step.step == 1 and step.values["groups_accepted"] == 1 and step.values["steps_skipped"] == 0
    assert step.values["response_length_mean"] == pytest.approx(sum(lengths) / 4), "the four choices trained"


def test_garbage_requests_get_a_4xx_with_a_reason_and_the_proxy_keeps_serving():
    task = _task()
    ctx = _ctx(task, Scripted(task.renderer), max_seq_len=12)

    async def main() -> list[tuple[int, str]]:
        with server().session(ctx) as s:
            url = s.endpoint.base_url + "/chat/completions"
            auth = {"Authorization": f"Bearer {s.endpoint.api_key}"}
            good = {"model": "m", "messages": ROW["messages"]}
            cases = [
                dict(content=b"{not json", headers=auth),
                dict(json=good, headers={"Authorization": "Bearer sk-nobody"}),
                dict(json={"messages": [{"role": "user", "content": 5}]}, headers=auth),
                dict(json={**good, "n": MAX_CHOICES + 1}, headers=auth),
                dict(json={**good, "stream": "yes"}, headers=auth),
                dict(json={**good, "max_tokens": 0}, headers=auth),
                dict(json={"messages": [{"role": "user", "content": "1+1=" * 8}]}, headers=auth),
                dict(json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, headers=auth),
                dict(json=good, headers=auth, url=s.endpoint.base_url + "/completions"),
                dict(json=good, headers=auth),
            ]

            def post(case):
                with httpx.Client(timeout=30) as http:
                    r = http.post(case.pop("url", url), **case)
                return r.status_code, r.json().get("error", {}).get("message", "")

            return [await anyio.to_thread.run_sync(post, c) for c in cases]

    out = anyio.run(main)
    assert [code for code, _ in out] == [400, 401, 400, 400, 400, 400, 400, 400, 404, 200], out
    reasons = [why for _, why in out]
    assert "JSON" in reasons[0] and "unknown API key" in reasons[1]
    assert "$.messages[0].content" in reasons[2] and f"n must be between 1 and {MAX_CHOICES}" in reasons[3]
    assert "$.stream" in reasons[4] and "max_tokens" in reasons[5]
    assert "no room under max_seq_len 12" in reasons[6] and "only text content" in reasons[7]
    assert "/v1/chat/completions" in reasons[8]


@pytest.mark.parametrize("raises", [True, False])
def test_an_agent_that_never_calls_or_raises_loses_only_its_episode_or_rollout(raises):
    from producers.episodes import to_sample
    from streamer.errors import EpisodeRejected

    task = _task()

    @proxied
    async def lazy(row, endpoint):
        if raises:
            raise RuntimeError("agent crashed")
        return 1.0

    if raises:
        with pytest.raises(BaseExceptionGroup):
            anyio.run(lazy, ROW, _ctx(task, Scripted(task.renderer)))
    else:
        (ep,) = anyio.run(lazy, ROW, _ctx(task, Scripted(task.renderer)))
        with pytest.raises(EpisodeRejected, match="prompt segment"):
            to_sample(ep, vocab_size=len(task.renderer.tokenizer))
    assert not server().sessions


def test_the_readme_rollout_examples_run_as_written():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    rollout, agent = (next(b for b in blocks if marker in b) for marker in ("@episodes", "@proxied"))
    task = _task()
    for code, name in ((rollout, "rollout"), (agent, "agent")):
        namespace: dict = {}
        exec(compile(code, f"README.md ({name})", "exec"), namespace)
        (ep,) = anyio.run(namespace[name], ROW, _ctx(task, Scripted(task.renderer, "5")))
        assert ep.reward == 1.0 and ep.metrics["turns"] == 1, name


def test_an_engine_failure_reaches_the_producer_as_an_outage_not_an_agent_error():
    from streamer.errors import SamplerError

    task = _task()

    class Down(Scripted):
        def sample(self, *args, **kwargs):
            raise SamplerError("server gone")

    seen = []

    @proxied
    async def agent(row, endpoint):
        try:
            await _chat(endpoint, row["messages"])
        except openai.APIStatusError as e:  # the agent sees a 502 and gives up its own way
            seen.append(e.status_code)
            raise RuntimeError("agent gave up") from e
        return 1.0

    with pytest.raises(BaseExceptionGroup) as group:
        anyio.run(agent, ROW, _ctx(task, Down(task.renderer)))
    assert seen == [502] and isinstance(group.value.exceptions[0], SamplerError)
