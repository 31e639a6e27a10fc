"""Black-box agents through the producer's OpenAI-compatible proxy (producers/proxy.py), driven
by the real OpenAI client: calls that extend a chain, re-tokenize it (a counted divergence)
or start a new conversation; a whole producer step with an agent; garbage requests get a
4xx with a reason and the proxy keeps serving."""

from __future__ import annotations

import anyio
import httpx
import openai
import pytest
from contexts import Scripted, context, threaded

from producers.components import load_task
from producers.producer import Producer
from producers.proxy import Endpoint, proxied, server
from schemas import MetricsEvent, TrajectoryGroup, decode
from streamer import demo
from streamer.config import RunConfig, replace
from streamer.rollout.contract import RolloutContext

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
                dict(json={**good, "n": 2}, headers=auth),
                dict(json={**good, "stream": True}, headers=auth),
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
    assert "$.messages[0].content" in reasons[2] and "n must be 1" in reasons[3]
    assert "stream" in reasons[4] and "max_tokens" in reasons[5]
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
