"""Updates that land while requests are in flight (producers/reload.py, producers/streaming.py),
against the project's test server modeling vLLM's and SGLang's pause controls: every token
is stamped with the version that produced it, in each mode, from one process or two. The
same against a real vLLM is in tests/test_vllm.py."""

from __future__ import annotations

import logging
import threading

import pytest
from waits import wait_until

from producers import engines, reload
from producers.fake_server import FakeCompletionsServer, canned
from producers.reload import ServerVersions, server_id
from producers.remote_sampler import RemoteSampler
from producers.samplers import Completion
from streamer import problems
from streamer.errors import SamplerError

TOKENS = list(range(1, 41))  # never a stop token: every completion is 40 tokens long
PROMPT = [7, 8]


def _going_on(body: dict) -> list[Completion]:
    """TOKENS, or what is left of them after a prompt that holds the first ones (a request
    that goes on from its tokens so far)."""
    done = len(body["prompt"]) - len(PROMPT)
    rest = TOKENS[done : done + int(body["max_tokens"])]
    return [Completion(rest, [-0.5] * len(rest), "length")] * int(body.get("n", 1))


def _sampler(server, client, keys, mode: str, engine: str = "vllm", **kwargs) -> RemoteSampler:
    sampler = RemoteSampler(
        base_url=server.url, model="m", stop_ids=[], engine=engines.profile(engine), retries=0, **kwargs
    )
    sampler.attach(ServerVersions(client, keys, server.url, lock_seconds=30, mode=mode, poll=0.005))
    return sampler


def _version_of(logprob: float) -> int:
    return round(-logprob * 100) - 1  # the test server's mark (mark_versions)


def _run(samplers, server, *, requests: int = 4) -> list:
    """``requests`` concurrent calls of n=2 per sampler, an update to version 1 by the first
    sampler once tokens flow; the completions."""
    out: list = []
    errors: list = []

    def ask(sampler) -> None:
        try:
            out.extend(sampler.sample(PROMPT, n=2, temperature=1.0, top_p=1.0, max_new_tokens=len(TOKENS)))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(s,)) for s in samplers for _ in range(requests)]
    for t in threads:
        t.start()
    wait_until(lambda: server.requests >= len(threads), timeout=10, what="every request sent")
    if samplers[0].server.mode == "drain":
        wait_until(lambda: server.in_flight >= 1, timeout=10, what="a request in flight")
    else:
        flights = lambda: [f for s in samplers for f in list(s.server._flights.values())]  # noqa: E731
        wait_until(lambda: any(f.chunks for f in flights()), timeout=10, what="tokens streaming")
    first = samplers[0]
    first.server.ensure(1, lambda: first.reload("/weights/v1"), engine=first)
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert len(out) == 2 * len(threads)
    return out


def _assert_exact(completions) -> tuple[int, int]:
    """Every token's stamp is the version that produced it; (spanning completions, new-version tokens)."""
    spanning = new = 0
    for c in completions:
        assert c.token_ids == TOKENS, c.token_ids
        stamped = [v for a, b, v in c.runs() for _ in range(a, b)]
        truth = [_version_of(lp) for lp in c.logprobs]
        assert stamped == truth, (c.switches, truth)
        spanning += c.switches is not None
        new += truth.count(1)
    return spanning, new


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", ["drain", "keep", "abort"])
def test_each_token_is_stamped_with_the_version_that_produced_it(client, keys, mode, engine):
    with FakeCompletionsServer(_going_on, latency=0.2, token_delay=0.01, mark_versions=True) as server:
        sampler = _sampler(server, client, keys, mode, engine, concurrency=8)
        try:
            spanning, _ = _assert_exact(_run([sampler], server))
        finally:
            sampler.close()
    assert server.version == 1 and server.paused == ""
    if mode == "drain":  # no request spans an update
        assert spanning == 0
    else:
        assert spanning > 0
    if engine == "vllm":
        pause = {"drain": "wait", "keep": "keep", "abort": "abort"}[mode]
        running = "true" if mode == "keep" else "false"
        assert server.paths == [
            f"/pause?mode={pause}",
            "/collective_rpc",
            f"/reset_prefix_cache?reset_running_requests={running}",
            "/resume",
        ]
    else:
        pause = [] if mode == "drain" else ["/pause_generation"]
        assert server.paths == [*pause, "/update_weights_from_disk", "/continue_generation"]


@pytest.mark.parametrize("mode", ["drain", "keep", "abort"])
def test_two_processes_sharing_a_server_both_stamp_every_token_right(client, keys, mode):
    """The update is run by one process; the other's requests in flight take part through
    the server's record (its own ServerVersions, as another process would have)."""
    with FakeCompletionsServer(_going_on, latency=0.2, token_delay=0.01, mark_versions=True) as server:
        samplers = [_sampler(server, client, keys, mode, concurrency=4) for _ in range(2)]
        try:
            out = _run(samplers, server, requests=3)
        finally:
            for s in samplers:
                s.close()
    spanning, new = _assert_exact(out)
    assert (spanning > 0) == (mode != "drain")
    assert samplers[1].server.reloads == 0 and samplers[0].server.reloads == 1


def test_a_request_after_an_update_is_stamped_with_the_new_version(client, keys):
    with FakeCompletionsServer(canned(TOKENS), mark_versions=True) as server:
        sampler = _sampler(server, client, keys, "keep")
        try:
            sampler.server.ensure(1, lambda: sampler.reload("/weights/v1"), engine=sampler)
            (c,) = sampler.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=40)
        finally:
            sampler.close()
    assert c.version == 1 and c.switches is None and {_version_of(lp) for lp in c.logprobs} == {1}


def test_an_engine_without_pause_refuses_keep_at_start_and_says_which_modes_remain(client, keys, caplog):
    with FakeCompletionsServer(canned(TOKENS), pauses=False) as server, caplog.at_level(logging.WARNING):
        keep = _sampler(server, client, keys, "keep")
        with pytest.raises(
            SamplerError, match=r"has no /pause.*'keep' cannot work; 'drain' and 'abort' remain"
        ):
            keep.check_updates()
        drain = _sampler(server, client, keys, "drain")
        drain.check_updates()  # one line, and the update runs unpaused
        assert "'drain' and 'abort' remain" in caplog.text
        drain.server.ensure(1, lambda: drain.reload("/weights/v1"), engine=drain)
        assert server.paths == ["/collective_rpc", "/reset_prefix_cache?reset_running_requests=false"]
        keep.close()
        drain.close()


def test_a_failed_prefix_cache_reset_is_an_error_and_generation_resumes(client, keys):
    with FakeCompletionsServer(canned(TOKENS)) as server:
        server.reset_fails = engines.Vllm.RESET_TRIES
        sampler = _sampler(server, client, keys, "drain")
        try:
            with pytest.raises(SamplerError, match="did not reset its prefix cache"):
                sampler.server.ensure(1, lambda: sampler.reload("/weights/v1"), engine=sampler)
            assert server.paths[-1] == "/resume" and server.paused == ""
            assert sampler.server.served() == -1, "a version whose reset failed is not recorded as served"
            assert client.get(sampler.server.update_key) is None  # requests may go out again
        finally:
            sampler.close()


def test_an_update_that_never_ends_is_bounded_and_named(client, keys, monkeypatch):
    """A process that died mid-update leaves its record: requests wait for it to expire,
    `status` names the wait, and past a bound they fail (an engine outage, which status
    names too) instead of waiting for ever."""
    monkeypatch.setattr(reload, "REPORT_AFTER", 0.05)
    with FakeCompletionsServer(canned(TOKENS)) as server:
        sampler = _sampler(server, client, keys, "drain")
        sampler.server.lock_seconds = 0.5
        sampler.server.who = "producer p (engine update)"
        client.set(keys.engine_update(server_id(server.url)), "keep:loaded:3")  # no expiry: a bad record
        try:
            with pytest.raises(
                SamplerError, match=r"an update \(\('keep', 'loaded', 3\)\) has held generation"
            ):
                sampler.sample([1], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4)
        finally:
            sampler.close()
    said = problems.parse(client.hgetall(keys.problems))
    assert "requests held" in said["producer p (engine update)"].what, said


def test_a_drain_process_and_a_keep_process_on_one_server_both_stamp_right(client, keys):
    """Processes configured differently: the keep update waits for the drain process's
    unstreamed requests to end before it pauses, and streams the rest."""
    with FakeCompletionsServer(_going_on, latency=0.2, token_delay=0.01, mark_versions=True) as server:
        keep = _sampler(server, client, keys, "keep", concurrency=4)
        drain = _sampler(server, client, keys, "drain", concurrency=4)
        try:
            out = _run([keep, drain], server, requests=3)
        finally:
            keep.close()
            drain.close()
    spanning, _ = _assert_exact(out)
    assert spanning > 0


def test_a_server_that_lost_the_record_stamps_the_version_this_process_knew(client, keys):
    """The Redis server lost its data (the served record with it): requests are stamped with
    the newest version this process saw served, not 0, and the record is written back."""
    with FakeCompletionsServer(canned(TOKENS), mark_versions=True) as server:
        sampler = _sampler(server, client, keys, "drain")
        try:
            sampler.server.ensure(1, lambda: sampler.reload("/weights/v1"), engine=sampler)
            client.delete(sampler.server.served_key)
            (c,) = sampler.sample(PROMPT, n=1, temperature=1.0, top_p=1.0, max_new_tokens=40)
        finally:
            sampler.close()
    assert c.version == 1 and {_version_of(lp) for lp in c.logprobs} == {1}
    assert sampler.server.served() == 1
