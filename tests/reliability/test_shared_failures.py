"""A failure every row shares is the engine's or the weights', not the rows': when rollouts
fail the same way on several different rows with no success between, the producer forgives
the attempts it had charged (a row skipped for them comes back), charges none after,
backs off, says so in its log and in `streamer status`, and clears that once a rollout
works again."""

from __future__ import annotations

from producers.components import build
from producers.outages import SYSTEMIC_ROWS
from producers.producer import Producer
from streamer.config import RunConfig, replace
from streamer.readmodel import snapshot
from streamer.rollout.contract import episodes


def test_rows_failing_the_same_way_are_not_charged_and_status_names_it(client, keys, redis_url, tmp_path):
    broken = {"on": True}

    @episodes
    async def rollout(row, ctx, index):
        if broken["on"]:  # what NaN weights do to a sampler: the same error on every row
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        (c,) = await ctx.sample(ctx.task.renderer.render(row))
        return _episode(ctx, row, c)

    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 2, "max_new_tokens": 2, "max_row_attempts": 2, "torch_threads": 1},
        trainer={"groups_per_step": 1000},
    )
    task, sampler = build(cfg)
    producer = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler, rollout=rollout)

    async def no_wait(seconds):  # the backoff itself is not under test
        producer.backoffs.append(seconds)

    producer.backoffs = []
    producer.outages.backoff = no_wait
    outcomes = [producer.step() for _ in range(10)]
    assert outcomes == ["failed"] * 10
    # each row fails max_row_attempts (2) times, is skipped, the next is tried: the pattern shows
    # on the third row's first failure, after 2 + 2 charged failures
    before = 2 * (SYSTEMIC_ROWS - 1)
    assert not client.hlen(keys.row_attempts), "failures charged to the rows were not forgiven"
    assert not client.hlen(keys.skipped_rows), "rows stayed skipped for a failure that was not theirs"
    assert len(producer.backoffs) == 10 - before and producer.backoffs == sorted(producer.backoffs)
    problems = snapshot(client, keys).problems
    assert "every row fails the same way" in problems.get("producer p", ""), problems

    broken["on"] = False
    assert producer.step() == "published"
    assert not snapshot(client, keys).problems, "the problem stayed after a rollout worked"
    producer.close()


def _episode(ctx, row, completion):
    from streamer.rollout.trajectory import Trajectory

    t = Trajectory(ctx.task.renderer.render(row))
    t.extend(t.next_prompt(), completion)
    return t.episode(1.0 if completion.token_ids else 0.0)
