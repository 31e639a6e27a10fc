"""Hostile replies from a rollout service or an inference engine: every field is checked for
what it can mean, and a bad reply is a dropped rollout with its reason, never a crash of the
producer (token ids past int64, versions past uint64 or newer than any published, positive
log-probs, a reply larger than ``producer.max_reply_bytes`` or one that trickles in)."""

from __future__ import annotations

import itertools
import json
import socketserver
import threading
import time

import pytest
from harness import report, run_config_in
from producing import counters, make_producer, nothing_held, run_cfg

from producers import rollout_service
from schemas import TrajectoryGroup, decode
from streamer.rollout.contract import Episode, Segment, episodes


class RawServer:
    """An HTTP server on a free port whose replies are written byte by byte by ``answer(path,
    write, stop)``: whatever a hostile service or engine could send."""

    def __init__(self, answer):
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return
                    head += line
                path = head.split(b" ")[1].decode()
                length = next(
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                )
                self.rfile.read(length)
                try:
                    answer(path, self._write, outer.stop)
                except OSError:  # the producer hung up: what it should do with a hostile reply
                    pass

            def _write(self, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _json_reply(payload) -> bytes:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(raw),
        raw,
    )


def _episode(*, tokens=(9, 5), logprobs=(-0.2, -0.1), version=0, reward=1.0) -> dict:
    sampled = {"tokens": list(tokens), "logprobs": list(logprobs), "version": version}
    return {"segments": [{"tokens": [3, 8]}, sampled], "reward": reward}


def _service(episode: dict) -> RawServer:
    return RawServer(lambda path, write, stop: write(_json_reply({"episodes": [episode, episode]})))


@pytest.mark.parametrize(
    "episode, reason, says",
    [
        (_episode(tokens=(9, 2**63)), "bad_token", "token id 9223372036854775808 outside the vocabulary"),
        (_episode(tokens=(9, -(2**70))), "bad_token", "outside the vocabulary"),
        (_episode(version=2**64 + 5), "malformed", "version 18446744073709551621 was never published"),
        (_episode(version=10**9), "malformed", "version 1000000000 was never published (newest: 3)"),
        (_episode(version=-1), "malformed", "version -1 was never published"),
        (_episode(logprobs=(-0.2, 3.0)), "bad_logprob", "log-prob is 3 > 0"),
    ],
)
def test_a_hostile_field_from_a_rollout_service_drops_the_episodes_with_their_reason(
    keys, redis_url, tmp_path, client, caplog, episode, reason, says
):
    client.set(keys.version, 3)  # the newest version the trainer published
    with _service(episode) as service:
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=service.url), client)
        assert p.step() == "dropped", "the producer goes on"
    assert counters(client, keys)[f"episodes_dropped_{reason}"] == 2 and client.xlen(keys.traj) == 0
    assert says in caplog.text
    nothing_held(client, keys)


def test_a_published_version_and_a_log_prob_rounded_above_zero_are_trained(keys, redis_url, tmp_path, client):
    client.set(keys.version, 3)
    with _service(_episode(version=3, logprobs=(-0.2, 5e-5))) as service:
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=service.url), client)
        assert p.step() == "published"
    ((_, fields),) = client.xrange(keys.traj)
    group = decode(fields[b"d"], TrajectoryGroup)
    assert group.policy_version == 3
    assert [s.sampler_logprobs().tolist() for s in group.samples] == [[-0.20000000298023224, 0.0]] * 2


@pytest.mark.parametrize(
    "episode, reason",
    [
        (Episode([Segment([3, 8]), Segment([9], [-0.1], 0)], 10**400), "bad_reward"),
        (Episode([Segment([3, 8]), Segment([2**63], [-0.1], 0)], 1.0), "bad_token"),
        (Episode([Segment([3, 8]), Segment(["x"], [-0.1], 0)], 1.0), "bad_token"),
        (Episode(None, 1.0), "malformed"),
        (Episode([Segment([3, 8]), Segment(None, [-0.1], 0)], 1.0), "malformed"),
    ],
)
def test_junk_from_a_rollout_function_drops_the_episodes_with_their_reason(
    keys, redis_url, tmp_path, client, episode, reason
):
    @episodes
    async def junk(row, ctx, index):
        return episode

    p = make_producer(run_cfg(keys, redis_url, tmp_path), client, rollout=junk)
    assert p.step() == "dropped"
    assert counters(client, keys)[f"episodes_dropped_{reason}"] == 2
    nothing_held(client, keys)


def _engine(choice: dict) -> RawServer:
    return RawServer(
        lambda path, write, stop: write(_json_reply({"choices": [choice, {**choice, "index": 1}]}))
    )


@pytest.mark.parametrize(
    "choice, reason, says",
    [
        ({"token_ids": [7, 2**63]}, "bad_token", "token id 9223372036854775808, not an int32 id"),
        ({"token_ids": [7, 2**31]}, "bad_token", "token id 2147483648, not an int32 id"),
        ({"token_ids": [7, 6.0]}, "bad_token", "token id 6.0, not an int32 id"),
        ({"token_ids": [7, 6], "lp": [-0.1, "x"]}, "bad_logprob", "log-prob 'x', not a number"),
        ({"token_ids": [7, 6], "lp": [-0.1, 10**400]}, "bad_logprob", "past float's range"),
        ({"tokens": ["token_id:7", "token_id:9" * 3000]}, "bad_token", "not an int32 id"),
        ({"token_ids": [7, 6], "lp": [-0.1, 2.5]}, "bad_logprob", "log-prob is 2.5 > 0"),
    ],
)
def test_a_hostile_engine_answer_drops_the_rollout_with_its_reason(
    keys, redis_url, tmp_path, client, caplog, choice, reason, says
):
    lp = {"token_logprobs": choice.pop("lp", [-0.1, -0.2]), "tokens": choice.pop("tokens", [])}
    with _engine({"index": 0, "logprobs": lp, "finish_reason": "length", **choice}) as engine:
        cfg = run_cfg(keys, redis_url, tmp_path, sampler="remote", remote_url=engine.url, remote_retries=0)
        p = make_producer(cfg, client)
        assert p.step() in ("failed", "dropped"), "the producer goes on"
    p.trips.flush_metrics()
    assert counters(client, keys)[f"episodes_dropped_{reason}"] == 2 and client.xlen(keys.traj) == 0
    assert says in caplog.text
    nothing_held(client, keys)


def _reason(client, keys) -> str:
    (reason,) = [k for k, v in counters(client, keys).items() if k.startswith("episodes_dropped_") and v]
    return reason.removeprefix("episodes_dropped_")


def _padded(size: int) -> bytes:
    """A valid reply of ``size`` bytes (JSON allows any amount of whitespace)."""
    raw = json.dumps({"episodes": [_episode(), _episode()]}).encode()
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.mark.parametrize(
    "reply",
    [
        # a Content-Length of 300 MB, then nothing: refused from the headers, not waited for
        b"HTTP/1.1 200 OK\r\nContent-Length: 300000000\r\n\r\n{",
        # 1 MB of valid JSON, chunked (no length announced): refused once 64 KiB have arrived
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
        % (1 << 20, _padded(1 << 20)),
    ],
    ids=["declared", "chunked"],
)
def test_a_reply_larger_than_max_reply_bytes_drops_the_rollout(
    keys, redis_url, tmp_path, client, caplog, reply
):
    def answer(path, write, stop):
        write(reply)
        stop.wait(30)  # holds the connection open, as a stalled or huge sender would

    with RawServer(answer) as service:
        cfg = run_cfg(
            keys, redis_url, tmp_path, rollout=service.url, max_reply_bytes=65536, rollout_timeout=10
        )
        p = make_producer(cfg, client)
        start = time.monotonic()
        assert p.step() == "failed"
        elapsed = time.monotonic() - start
    p.trips.flush_metrics()
    assert _reason(client, keys) == "malformed" and "max_reply_bytes = 65536" in caplog.text
    assert elapsed < 5, f"{elapsed:.1f}s: the reply was waited for, not refused"
    assert client.lrange(keys.requeue, 0, -1) == [b"0"], "the row is handed back"
    nothing_held(client, keys)


def test_a_service_that_trickles_its_reply_is_cut_at_the_deadline(
    keys, redis_url, tmp_path, client, caplog, monkeypatch
):
    # stands for the 600 s a service's whole reply may take when rollout_timeout = 0
    monkeypatch.setattr(rollout_service, "SERVICE_TIMEOUT", 1.5)

    def answer(path, write, stop):
        write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(0.1):  # a byte every 0.1 s: no read ever times out
            write(b" ")

    outcome: list[str] = []
    with RawServer(answer) as service:
        p = make_producer(run_cfg(keys, redis_url, tmp_path, rollout=service.url), client)
        start = time.monotonic()
        worker = threading.Thread(target=lambda: outcome.append(p.step()), daemon=True)
        worker.start()
        worker.join(30)
        elapsed = time.monotonic() - start
    assert outcome == ["failed"], f"still reading after {elapsed:.0f}s"
    p.trips.flush_metrics()
    assert _reason(client, keys) == "timeout" and "no complete answer within" in caplog.text
    assert elapsed < 10, elapsed
    nothing_held(client, keys)


@pytest.mark.slow
def test_a_producer_process_fed_hostile_replies_keeps_producing(procs, redis_url, keys, tmp_path, client):
    hostile = [
        _episode(tokens=(9, 2**63)),
        _episode(version=2**64 + 5),
        _episode(version=10**9),
        _episode(logprobs=(-0.2, 3.0)),
        None,  # a reply over max_reply_bytes
    ]
    calls = itertools.count()

    def answer(path, write, stop):
        i = next(calls)
        episode = hostile[i % 6] if i % 6 < len(hostile) else _episode()
        if episode is None:
            return write(_json_reply(_padded(1 << 16)))
        write(_json_reply({"episodes": [episode, episode]}))

    with RawServer(answer) as service:
        producer = {"rollout": service.url, "group_size": 2, "min_group_size": 2, "max_groups": 3}
        config = run_config_in(tmp_path, keys, producer={**producer, "max_reply_bytes": 4096})
        procs.start("producer", "produce", "--config", str(config), "--redis-url", redis_url)
        code = procs.wait("producer", 180)
    log = procs.log("producer")
    counted = counters(client, keys)
    dropped = {k: v for k, v in counted.items() if k.startswith("episodes_dropped_") and v}
    report(
        "hostile-replies", exit=code, published=client.xlen(keys.traj), service_calls=next(calls), **dropped
    )
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert client.xlen(keys.traj) == 3
    for reason in ("bad_token", "malformed", "bad_logprob"):
        assert counted.get(f"episodes_dropped_{reason}", 0) >= 2, (reason, dropped)
