"""Rollout functions in a producer against a real server: per-turn versions, many rows in
flight, and rollouts that raise, hang or return garbage (dropped, counted, row handed back,
nothing published)."""

from __future__ import annotations

import copy
import re
import threading
import time

import anyio
import pytest
import redis
from producing import counters, make_producer, nothing_held, run_cfg

from consumers.filters import is_stale
from producers.episodes import to_sample
from producers.single_turn import single_turn
from schemas import MetricsEvent, TrajectoryGroup, WeightSync, decode, encode
from streamer import demo, weights
from streamer.errors import ConfigError, EpisodeRejected
from streamer.rollout.batching import MicroBatcher
from streamer.rollout.contract import Completion, Episode, Segment, episodes
from streamer.rollout.trajectory import Trajectory


def _groups(client, keys) -> list[TrajectoryGroup]:
    return [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]


def test_rollout_is_named_by_import_path(keys, redis_url, tmp_path, client):
    cfg = run_cfg(keys, redis_url, tmp_path, rollout="producers.single_turn:single_turn")
    assert make_producer(cfg, client).rollout is single_turn
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        make_producer(run_cfg(keys, redis_url, tmp_path, rollout="producers.single_turn:nope"), client)


def test_a_weight_change_between_turns_shows_both_versions_and_the_group_is_judged_by_the_older(
    keys, redis_url, tmp_path, client
):
    cfg = run_cfg(keys, redis_url, tmp_path)
    uri, sha = weights.write_version(demo.build_model(seed=5), cfg.weights_dir, 1)

    @episodes
    async def two_turns(row, ctx, i):
        t = Trajectory(ctx.task.renderer.render(row))
        (c,) = await ctx.sample(t.next_prompt())
        t.extend(t.next_prompt(), c)
        if i == 0:  # the trainer publishes version 1 while episode 0 is between its turns
            client.xadd(keys.policy, {b"d": encode(WeightSync(version=1, step=1, uri=uri, sha256=sha))})
        t.append_messages(ctx.task.renderer, [{"role": "user", "content": "1+1="}])
        (c2,) = await ctx.sample(t.next_prompt())
        t.extend(t.next_prompt(), c2)
        return t.episode(1.0 if i else 0.0)

    assert make_producer(cfg, client, rollout=two_turns).step() == "published"
    (g,) = _groups(client, keys)
    versions = {v for s in g.samples for v in s.token_versions().tolist() if v >= 0}
    assert versions == {0, 1}, "both versions are recorded, per turn"
    assert g.policy_version == 0 and min(s.version for s in g.samples) == 0
    assert is_stale(g, version=2, max_staleness=1), "judged by its oldest turn"
    for s in g.samples:  # the environment's message is in the context with weight 0
        assert (s.loss_mask()[s.token_versions() < 0] == 0).all() and s.spans is not None


def test_rows_in_flight_at_once_each_with_a_lease_and_a_slot(keys, redis_url, tmp_path, client):
    n = 4
    cfg = run_cfg(keys, redis_url, tmp_path, concurrency=n, max_groups=8)
    state = {"in": 0, "peak": 0}

    async def gathered(row, ctx):
        state["in"] += 1
        state["peak"] = max(state["peak"], state["in"])
        with anyio.fail_after(30):  # the first n rows wait for each other: n really in flight
            while state["peak"] < n:
                await anyio.sleep(0.01)
        try:
            return await single_turn(row, ctx)
        finally:
            state["in"] -= 1

    p = make_producer(cfg, client, rollout=gathered)
    assert p.run() == 0
    groups = _groups(client, keys)
    assert state["peak"] == n and len(groups) == 8 and len({g.group_id for g in groups}) == 8
    assert max(_metric_values(client, keys, "in_flight_episodes")) >= 2
    nothing_held(client, keys)


def _metric_values(client, keys, name):
    return [decode(f[b"d"], MetricsEvent).values.get(name, 0.0) for _, f in client.xrange(keys.metrics)]


def test_a_rollout_that_raises_hands_its_row_back_and_is_skipped_after_repeated_failures(
    keys, redis_url, tmp_path, client, caplog
):
    async def broken(row, ctx):
        raise RuntimeError("environment crashed")

    cfg = run_cfg(keys, redis_url, tmp_path)
    attempts = cfg.producer.max_row_attempts
    p = make_producer(cfg, client, rollout=broken)
    outcomes = [p.step() for _ in range(attempts)]
    assert outcomes == ["failed"] * attempts
    assert client.lrange(keys.requeue, 0, -1) == [b"0"] and int(client.get(keys.cursor)) == 1, "one row"
    assert "raised RuntimeError: environment crashed; row handed back" in caplog.text
    # the next claim skips it (the count is the server's: any producer's failures add up)
    assert p.step() == "failed" and int(client.get(keys.cursor)) == 2
    skipped = client.hgetall(keys.skipped_rows)
    assert list(skipped) == [b"0"], skipped
    assert skipped[b"0"].decode() == (
        f"{attempts} attempts failed; last: rollout raised RuntimeError: environment crashed"
    )
    p.trips.flush_metrics()
    assert counters(client, keys)["episodes_dropped_error"] == 2 * (attempts + 1)
    assert client.xlen(keys.traj) == 0
    nothing_held(client, keys)


def test_a_server_outage_inside_a_rollout_is_not_the_rows_failure(keys, redis_url, tmp_path, client):
    """A rollout's server call that times out (say, following weights while the server
    stalls) hands the row back uncounted and goes to the producer's outage backoff: a few
    outages must not skip a healthy row."""

    async def stalls(row, ctx):
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    cfg = run_cfg(keys, redis_url, tmp_path)
    p = make_producer(cfg, client, rollout=stalls)
    for _ in range(cfg.producer.max_row_attempts + 1):
        with pytest.raises(redis.exceptions.TimeoutError):
            p.step()
    assert client.hlen(keys.row_attempts) == 0 and client.hlen(keys.skipped_rows) == 0
    assert client.lrange(keys.requeue, 0, -1) == [b"0"], "handed back, first in line"
    nothing_held(client, keys)


def test_a_hung_rollout_is_cancelled_and_its_row_handed_back(keys, redis_url, tmp_path, client):
    async def hangs(row, ctx):
        await anyio.sleep_forever()

    p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout_timeout=0.3), client, rollout=hangs)
    assert p.step() == "failed"
    assert client.lrange(keys.requeue, 0, -1) == [b"0"], "the row is first in line again"
    p.trips.flush_metrics()
    assert counters(client, keys)["episodes_dropped_timeout"] == 2
    nothing_held(client, keys)


def test_a_log_prob_checked_as_it_is_sent():
    """Log-probs travel as float32: one finite in float64 but not in float32 is rejected,
    and an accepted episode's values arrive as given."""
    with pytest.raises(EpisodeRejected, match="NaN or infinite") as e:
        to_sample(Episode([Segment([1]), Segment([2], [-1e300], 0)], 1.0), vocab_size=10)
    assert e.value.reason == "bad_logprob"
    s = to_sample(Episode([Segment([1, 3]), Segment([2, 4], [-0.5, -0.25], 7)], 1.0), vocab_size=10)
    assert s.token_ids().tolist() == [1, 3, 2, 4] and s.prompt_len == 2 and s.version == 7
    assert s.sampler_logprobs().tolist() == [-0.5, -0.25] and s.mask is None and s.spans is None


def test_malformed_episodes_are_dropped_with_reasons_and_never_published(keys, redis_url, tmp_path, client):
    bad = [
        Episode([Segment([1]), Segment([2, 3], [-0.1], 0)], 1.0),  # lengths differ
        Episode([Segment([1]), Segment([2], [-0.1], 0), Segment([3], mask=[1])], 1.0),  # unsampled trained
        Episode([Segment([1]), Segment([10**6], [-0.1], 0)], 1.0),  # outside the vocabulary
        Episode([Segment([1]), Segment([2], [float("nan")], 0)], 1.0),  # NaN log-prob
        Episode([Segment([1] * 30), Segment([2], [-0.1], 0)], 1.0),  # > max_seq_len
    ]

    async def garbage(row, ctx):
        return bad

    p = make_producer(
        run_cfg(keys, redis_url, tmp_path, max_seq_len=20, group_size=5), client, rollout=garbage
    )
    assert p.step() == "dropped"
    c = counters(client, keys)
    assert c["episodes_dropped_malformed"] == 2 and c["episodes_dropped_bad_token"] == 1
    assert c["episodes_dropped_bad_logprob"] == 1 and c["episodes_dropped_too_long"] == 1
    assert client.xlen(keys.traj) == 0
    nothing_held(client, keys)
    good = Episode([Segment([1]), Segment([2], [-0.1], 0)], 1.0)

    async def mixed(row, ctx):
        return [*bad[:3], good, good]

    p = make_producer(run_cfg(keys, redis_url, tmp_path, group_size=5), client, rollout=mixed)
    assert p.step() == "published"  # the good ones are enough for min_group_size
    (g,) = _groups(client, keys)
    assert len(g.samples) == 2


def test_a_prefix_mismatch_is_counted_and_never_trained(keys, redis_url, tmp_path, client, caplog):
    async def rerenders(row, ctx):
        t = Trajectory(ctx.task.renderer.render(row))
        (c,) = await ctx.sample(t.next_prompt())
        t.extend(t.next_prompt(), c)
        t.extend(ctx.task.renderer.render(row), c)  # the history re-rendered without turn 1
        return [t.episode(1.0)]

    p = make_producer(run_cfg(keys, redis_url, tmp_path), client, rollout=rerenders)
    assert p.step() == "failed"
    p.trips.flush_metrics()
    assert counters(client, keys)["prefix_mismatches"] == 1 and client.xlen(keys.traj) == 0
    assert "prompt diverges from the trajectory at token" in caplog.text


def test_concurrent_engine_calls_on_a_local_model_are_batched():
    from streamer.rollout.batching import MicroBatcher

    calls = []

    async def run_batch(prompts, **kw):
        calls.append(len(prompts))
        return [[Completion([p[0]], [-1.0], "stop")] for p in prompts]

    batcher = MicroBatcher(run_batch)
    got = {}

    async def one(i):
        got[i] = await batcher.sample([i], n=1, temperature=1.0, top_p=1.0, max_new_tokens=1)

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)

    anyio.run(main)
    assert calls == [6] and all(got[i][0].token_ids == [i] for i in range(6))


def test_the_rows_of_a_wave_reach_one_batch_through_their_server_calls():
    """An in-process model's Redis calls run on the event loop: rows that each make theirs
    (a publish, a claim, an admission) before their engine call reach the batcher together."""
    import types

    from producers.transport import Transport

    calls, got, loop = [], {}, threading.get_ident()

    async def run_batch(prompts, **kw):
        calls.append(sorted(p[0] for p in prompts))
        return [[Completion([p[0]], [-1.0], "stop")] for p in prompts]

    def server_call():  # as long as a round trip to a local server takes
        assert threading.get_ident() == loop, "a Redis call left the event loop"
        time.sleep(0.002)

    sampler = types.SimpleNamespace(sample_many=None, max_parallel=1)
    transport = Transport(
        sampler, follower=None, trips=types.SimpleNamespace(pending=None), concurrency=8, reward_concurrency=1
    )
    transport.sample = MicroBatcher(run_batch).sample
    settings = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=1)

    async def row(i):
        for _ in range(3):
            await transport.redis(server_call)
        got[i] = await transport.sample([i], **settings)

    async def main():
        transport.start()
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(row, i)

    anyio.run(main)
    assert calls == [list(range(8))] and all(got[i][0].token_ids == [i] for i in range(8))


@pytest.mark.parametrize(
    "settings, rollout, on_the_loop",
    [
        ({}, None, True),  # the built-in single turn, one row in flight: nothing else could run
        ({"rollout_timeout": 30.0}, None, False),  # a timeout is enforced mid-call
        ({}, single_turn, False),  # a rollout of the user's may have other work in flight
        ({"concurrency": 2}, None, False),  # other rows may
    ],
)
def test_a_local_models_engine_call_runs_on_the_event_loop_only_when_nothing_else_could(
    keys, redis_url, tmp_path, client, settings, rollout, on_the_loop
):
    p = make_producer(run_cfg(keys, redis_url, tmp_path, **settings), client, rollout=rollout)
    threads, sample_many = [], p.sampler.sample_many

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        return sample_many(*args, **kwargs)

    p.sampler.sample_many = recorded
    assert p.step() == "published"
    assert len(threads) == 1 and (threads[0] == threading.get_ident()) == on_the_loop
    nothing_held(client, keys)


class _Service:
    """A rollout service on a free port that answers every POST with ``reply(body)``."""

    def __init__(self, reply):
        import json

        from producers import httpd

        self.requests: list[dict] = []
        service = self

        class Handler(httpd.JsonHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                status, payload = reply(body)
                if isinstance(payload, bytes):
                    return self.send_body(status, payload)
                self.send_json(status, payload)

        self.httpd = httpd.server(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/rollout"
        httpd.start(self.httpd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _episode_json(reward: float, version: int = 4) -> dict:
    return {
        "segments": [{"tokens": [3, 8]}, {"tokens": [9, 5], "logprobs": [-0.2, -0.1], "version": version}],
        "reward": reward,
        "metrics": {"turns": 1.0},
    }


def test_a_remote_rollout_service_returns_token_native_episodes(keys, redis_url, tmp_path, client):
    def reply(body):
        g = body["group_size"]
        return 200, {"episodes": [_episode_json(float(i)) for i in range(g)]}

    client.set(keys.version, 4)  # the version the service's engine sampled with is published
    with _Service(reply) as service:
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=service.url), client)
        assert p.step() == "published"
    (g,) = _groups(client, keys)
    assert [s.reward for s in g.samples] == [0.0, 1.0] and g.policy_version == 4
    assert g.samples[0].token_ids().tolist() == [3, 8, 9, 5] and g.samples[0].prompt_len == 2
    (request,) = service.requests
    assert request["row"] in p.task.rows and request["group_size"] == 2
    assert request["sampling"] == {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 2}


@pytest.mark.parametrize(
    "status, payload, reason, says",
    [
        (200, b"<html>oops", "malformed", "sent a bad reply"),
        (200, {"episodes": [{"segments": "no", "reward": 1.0}]}, "malformed", "$.episodes[0].segments"),
        (200, {"episodes": [{**_episode_json(1.0), "extra": 1}]}, "malformed", "unknown field `extra`"),
        (500, b"agent crashed", "error", "raised RuntimeError: the service answered 500: agent crashed"),
    ],
)
def test_a_bad_reply_from_a_rollout_service_drops_the_rollout_and_hands_the_row_back(
    keys, redis_url, tmp_path, client, caplog, status, payload, reason, says
):
    with _Service(lambda body: (status, payload)) as service:
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=service.url), client)
        assert p.step() == "failed"
    p.trips.flush_metrics()
    assert counters(client, keys)[f"episodes_dropped_{reason}"] == 2 and client.xlen(keys.traj) == 0
    assert says in caplog.text and re.search(r"row \d+ \(epoch 0\): rollout http://", caplog.text)
    assert client.lrange(keys.requeue, 0, -1) == [b"0"] and client.hlen(keys.row_attempts) == 1
    nothing_held(client, keys)


def test_an_unreachable_or_busy_rollout_service_is_an_outage_not_the_rows_failure(
    keys, redis_url, tmp_path, client
):
    with _Service(lambda body: (503, b"busy")) as service:
        busy = service.url
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=busy), client)
        p.stop.set()  # no backoff wait in the test
        assert p.step() == "error"
    p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=busy), client)  # now nothing listens there
    p.stop.set()
    assert p.step() == "error"
    assert client.hlen(keys.row_attempts) == 0, "an outage is not an attempt"
    assert client.lrange(keys.requeue, 0, -1) == [b"0"]
    nothing_held(client, keys)


def test_a_rollout_that_edits_its_row_leaves_the_dataset_as_it_was(keys, redis_url, tmp_path, client):
    seen = []

    async def edits(row, ctx):
        seen.append(dict(row))
        episodes = await single_turn(row, ctx)
        row["edited"] = True  # an environment keeping state in its row
        for value in row.values():
            if isinstance(value, list):
                value.append("turn")
        return episodes

    p = make_producer(run_cfg(keys, redis_url, tmp_path), client, rollout=edits)
    original = copy.deepcopy(p.task.rows)
    assert p.step() == "published"
    assert p.task.rows == original, "a later epoch would see the edited row"
    assert "edited" not in seen[0]
