"""Producers sharing one inference server reload it once per version, in version order, and
never stamp a sample with a version the server did not hold (producers/reload.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from test_producer import _cfg, _producer, _wait_for

from producers.fake_server import FakeCompletionsServer, canned
from producers.reload import ServerVersions
from producers.samplers import Completion
from schemas import TrajectoryGroup, WeightSync, decode, encode
from streamer import demo, weights

PRODUCERS, VERSIONS = 4, 4


def test_racing_producers_reload_each_version_once_and_never_backwards(client, keys):
    calls: list[int] = []
    shared = [ServerVersions(client, keys, "http://inference:8000", lock_seconds=10) for _ in range(8)]
    for version in (1, 2, 3, 5, 4):  # 4 after 5: already served, never loaded backwards
        barrier = threading.Barrier(len(shared))

        def race(s: ServerVersions, v: int = version, barrier=barrier) -> None:
            barrier.wait()
            s.ensure(v, lambda: calls.append(v))

        threads = [threading.Thread(target=race, args=(s,)) for s in shared]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert calls == [1, 2, 3, 5]
    assert shared[0].served() == 5 and sum(s.reloads for s in shared) == 4


class _LosesOneSetReply(redis.Redis):
    """A real client whose next SET reaches the server but whose reply is lost (as when the
    server stalls past the socket timeout and then runs the queued command)."""

    lose = True

    def set(self, *args, **kwargs):
        done = super().set(*args, **kwargs)
        if self.lose:
            self.lose = False
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return done


def test_a_lock_taken_by_a_lost_reply_is_still_ours(redis_url, keys):
    client = _LosesOneSetReply.from_url(redis_url)
    shared = ServerVersions(client, keys, "http://inference:8000", lock_seconds=5)
    with pytest.raises(redis.exceptions.TimeoutError):
        shared.ensure(1, lambda: None)  # the SET took the lock; its reply never came
    assert client.get(shared.lock_key) == shared.token.encode()
    loads: list[int] = []
    # before: a new token per try, so the producer waited for its own lock until it expired
    # (lock_seconds is ~500 s for a remote sampler's defaults), then gave up
    assert shared.ensure(2, lambda: loads.append(2)) == 2
    assert loads == [2] and client.get(shared.lock_key) is None


@pytest.mark.slow
def test_four_producers_one_reload_per_version_and_honest_stamps(client, keys, redis_url, tmp_path):
    tok = demo.tokenizer()

    def held() -> int:  # the version the fake server serves right now
        return int(Path(server.reloads[-1]).name[1:]) if server.reloads else 0

    def backend(body: dict) -> list[Completion]:
        # the log-prob carries the version the server held when it generated the sample
        ids = [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
        return [Completion(ids, [-(held() + 1) / 64] * 2, "stop")] * int(body.get("n", 1))

    with FakeCompletionsServer(backend) as server:
        cfg = _cfg(
            keys,
            redis_url,
            tmp_path,
            producer={
                "sampler": "remote",
                "remote_url": server.url,
                # one canned answer teaches nothing: rows must not step aside (and end the run)
                # before the versions below are published
                "defer_after": 0,
                "defer_failed_after": 0,
                "defer_pass_rate": 0,
            },
            bus={"max_unacked": 1_000_000},  # no trainer acknowledges here
        )
        stop = threading.Event()
        producers = [_producer(cfg, client, pid=f"p{i}", stop=stop) for i in range(PRODUCERS)]
        errors: list[str] = []
        threads = [threading.Thread(target=_loop, args=(p, stop, errors)) for p in producers]
        for t in threads:
            t.start()
        try:
            for version in range(1, VERSIONS + 1):
                uri, sha = weights.write_version(demo.build_model(seed=version), cfg.weights_dir, version)
                client.xadd(
                    keys.policy,
                    {b"d": encode(WeightSync(version=version, step=version, uri=uri, sha256=sha))},
                )
                _wait_for(
                    lambda v=version: errors or all(p.follower.version >= v for p in producers),
                    60,
                    f"every producer on version {version}",
                )
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            for p in producers:
                p.close()
        assert not errors, errors
        reloaded = [int(Path(r).name[1:]) for r in server.reloads]
    assert reloaded == list(range(1, VERSIONS + 1)), reloaded  # once per version, in order
    assert sum(p.follower.shared.reloads for p in producers) == VERSIONS
    groups = [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]
    stamps = [(s.version, round(-float(s.sampler_logprobs()[0]) * 64) - 1) for g in groups for s in g.samples]
    assert stamps and all(stamp <= was_held for stamp, was_held in stamps), stamps
    assert {stamp for stamp, _ in stamps} >= {0, VERSIONS}


def _loop(p, stop: threading.Event, errors: list) -> None:
    try:
        while not stop.is_set():
            if p.step() != "published":
                stop.wait(0.01)
    except Exception as e:  # reported by the test, not lost with the thread
        errors.append(f"{p.id}: {type(e).__name__}: {e}")
        stop.set()


def test_producers_that_did_not_reload_a_lora_adapter_still_sample_with_it(client, keys, tmp_path):
    """A LoRA adapter is named in every request: the producers that waited for another
    one's reload must switch to the adapter's name too (one load per version, all use it)."""
    from test_lora import _learner

    from producers.follow import WeightFollower
    from producers.remote_sampler import RemoteSampler

    learner = _learner()
    with FakeCompletionsServer(canned([5, demo.tokenizer().eos_token_id])) as server:
        remotes = [RemoteSampler(base_url=server.url, model="base", stop_ids=[0]) for _ in range(2)]
        followers = [WeightFollower(client, keys, weights_dir=tmp_path, sampler=r) for r in remotes]
        try:
            for version in (1, 2):
                uri, sha = weights.write_version(learner.publishable, tmp_path, version)
                sync = WeightSync(version=version, step=version, uri=uri, sha256=sha)
                client.xadd(keys.policy, {b"d": encode(sync)})
                assert all(f.update() for f in followers)
                assert {r.model for r in remotes} == {f"streamer-v{version:08d}"}
        finally:
            for r in remotes:
                r.close()
    assert sorted(server.adapters) == ["streamer-v00000001", "streamer-v00000002"]  # loaded once each
    assert sum(f.shared.reloads for f in followers) == 2
