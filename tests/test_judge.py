"""Rewards that call models: async rewards awaited concurrently under a bound and a timeout,
and the built-in judge against a local HTTP server; a judge that fails is an outage (the row
goes back, no attempt counted), one that answers without a number rejects the row, quoted."""

from __future__ import annotations

import json
import math
import threading

import anyio
import pytest
from contexts import context
from producing import counters
from waits import wait_until

from producers import httpd
from producers.components import build
from producers.inflight import first_leaf
from producers.producer import Producer
from producers.single_turn import single_turn
from schemas import MetricsEvent, TrajectoryGroup, decode
from streamer import demo
from streamer.config import RunConfig, replace
from streamer.errors import ConfigError, DatasetError, RewardUnavailable
from streamer.rollout.contract import Completion, RolloutContext

ROW = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}
HOLD_SECONDS = 10.0  # a judge request waits at most this long for the others to arrive


class JudgeServer:
    """An OpenAI-compatible judge on 127.0.0.1 (free port). No request is answered before
    ``hold`` requests have been in flight at once (waiting at most HOLD_SECONDS; past it: a
    500 saying so); then each gets ``reply(body) -> (status, payload)``. With ``hang`` no
    request is answered before the server closes."""

    def __init__(self, reply, *, hold: int = 1, hang: bool = False):
        self.requests: list[dict] = []
        self.ports: set[int] = set()  # the client's port of each connection a request came on
        self.paths: list[str] = []  # each request's target (absolute when sent to a proxy)
        self.in_flight = self.max_in_flight = 0
        self.cond = threading.Condition()
        self.done = threading.Event()  # set at exit: hung requests let go
        judge = self

        class Handler(httpd.JsonHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if not raw:  # the client gave up on this connection
                    return
                body = json.loads(raw)
                with judge.cond:
                    judge.requests.append(body)
                    judge.paths.append(self.path)
                    judge.ports.add(self.client_address[1])
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                    judge.cond.notify_all()
                    together = judge.cond.wait_for(lambda: judge.max_in_flight >= hold, timeout=HOLD_SECONDS)
                try:
                    if hang:
                        judge.done.wait(HOLD_SECONDS)
                    if not together:
                        return self.send_json(500, {"error": f"not {hold} requests in flight at once"})
                    status, payload = reply(body)
                    if isinstance(payload, bytes):
                        return self.send_body(status, payload)
                    self.send_json(status, payload)
                finally:
                    with judge.cond:
                        judge.in_flight -= 1

        self.httpd = httpd.server(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        httpd.start(self.httpd, "judge")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def chat(content: str) -> tuple[int, dict]:
    return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


class Fixed:
    """A sampler whose G completions of any prompt are the texts given."""

    def __init__(self, renderer, texts):
        self.renderer, self.texts = renderer, texts

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        out = []
        for text in (self.texts * n)[:n]:
            ids = [*self.renderer.tokenizer.encode(text, add_special_tokens=False), self.renderer.stop_ids[0]]
            out.append(Completion(ids, [-0.5] * len(ids), "stop", version=0))
        return out


def _ctx(reward_fn, *, group_size: int = 4, limit: int = 4, timeout: float = 0.0) -> RolloutContext:
    from producers.components import load_task

    task = load_task(demo.config(), dataset="demo", rows=[ROW], reward_fn=reward_fn)
    sampler = Fixed(task.renderer, ["5", "4", "5", "3"])

    async def sample_fn(prompt_ids, **kwargs):
        return sampler.sample(prompt_ids, **kwargs)

    limiter = anyio.CapacityLimiter(limit)
    return context(task, sample_fn, group_size=group_size, reward_limiter=limiter, reward_timeout=timeout)


def test_async_reward_calls_of_a_group_are_awaited_at_once():
    inside, everyone = [0], None

    async def reward(row, text, sample):
        inside[0] += 1
        if inside[0] == 4:
            everyone.set()
        with anyio.fail_after(HOLD_SECONDS):  # sequential calls would never all be inside
            await everyone.wait()
        return float(text.strip() == row["answer"])

    async def main():
        nonlocal everyone
        everyone = anyio.Event()
        return await single_turn(ROW, _ctx(reward, limit=4))

    episodes = anyio.run(main)
    assert [e.reward for e in episodes] == [1.0, 0.0, 1.0, 0.0] and inside == [4]


def test_async_reward_calls_stay_within_the_concurrency_bound():
    inside, most = [0], [0]

    async def reward(row, text, sample):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        for _ in range(5):  # let every other call that may start, start
            await anyio.lowlevel.checkpoint()
        inside[0] -= 1
        return 1.0

    episodes = anyio.run(single_turn, ROW, _ctx(reward, limit=2))
    assert len(episodes) == 4 and most == [2]


def test_async_reward_past_its_timeout_is_an_outage_not_a_zero_reward():
    async def reward(row, text, sample):
        await anyio.sleep_forever()

    _assert_times_out(reward)


def _assert_times_out(reward) -> None:
    """A group of ``reward`` past a 0.2 s reward.timeout is an outage, not a zero reward."""
    with pytest.raises(BaseException) as e:
        anyio.run(single_turn, ROW, _ctx(reward, timeout=0.2))
    leaf = first_leaf(e.value)
    assert isinstance(leaf, RewardUnavailable) and "gave no answer within 0.2s" in str(leaf)


class GroupReward:
    """A reward with a ``score_group``: each call of it recorded; per sample it would fail."""

    def __init__(self, scores, *, asynchronous: bool = True):
        self.scores, self.calls = scores, []
        if asynchronous:

            async def score_group(row, texts, samples):
                return self._answer(row, texts, samples)

            self.score_group = score_group
        else:
            self.score_group = self._answer

    def _answer(self, row, texts, samples):
        self.calls.append((row, list(texts), len(samples)))
        return self.scores(texts)

    def __call__(self, row, text, sample=None):
        raise AssertionError("asked per sample, where score_group scores the group")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_group_reward_is_asked_once_a_group_and_its_scores_are_the_rewards(asynchronous):
    reward = GroupReward(lambda texts: [float(t == "5") for t in texts], asynchronous=asynchronous)
    episodes = anyio.run(single_turn, ROW, _ctx(reward, limit=1))
    assert reward.calls == [(ROW, ["5", "4", "5", "3"], 4)]
    assert [e.reward for e in episodes] == [1.0, 0.0, 1.0, 0.0]


def test_a_group_reward_that_fails_drops_its_samples_not_the_rollout(caplog):
    nan = GroupReward(lambda texts: [1.0, math.nan, 0.0, "x"])
    assert [e.reward for e in anyio.run(single_turn, ROW, _ctx(nan))] == [1.0, 0.0]
    short = GroupReward(lambda texts: [1.0])
    assert anyio.run(single_turn, ROW, _ctx(short)) == []
    assert "not a list of 4 scores" in caplog.text

    async def hangs(row, texts, samples):
        await anyio.sleep_forever()

    reward = GroupReward(lambda texts: [])
    reward.score_group = hangs
    _assert_times_out(reward)


def _cfg(keys, redis_url, tmp_path, url: str, *, attempts: int = 3, **judge) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={
            "group_size": 2,
            "min_group_size": 2,
            "max_new_tokens": 2,
            "torch_threads": 1,
            "reward": "judge",
            "max_row_attempts": attempts,
        },
        trainer={"groups_per_step": 1000},
        reward={"judge": {"url": url, "model": "judge-1", "retries": 0, **judge}},
    )


def test_judge_requests_of_a_group_run_at_once_and_their_scores_are_the_rewards(
    keys, redis_url, tmp_path, client
):
    with JudgeServer(lambda body: chat("Score: 0.75"), hold=2) as judge:
        cfg = _cfg(keys, redis_url, tmp_path, judge.url)
        task, sampler = build(cfg)
        p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        assert p.step() == "published"
    assert judge.max_in_flight == 2, "both requests were in flight before either was answered"
    (entry,) = client.xrange(keys.traj)
    group = decode(entry[1][b"d"], TrajectoryGroup)
    assert [s.reward for s in group.samples] == [0.75, 0.75]
    request = judge.requests[0]
    assert request["model"] == "judge-1" and request["temperature"] == 0.0
    (message,) = request["messages"]
    row = task.rows[group.row]
    assert f"Reference answer: {row['answer']}" in message["content"]
    assert f"Question: {row['messages'][-1]['content']}" in message["content"]


def test_a_batch_judge_scores_a_group_in_one_request_in_order(keys, redis_url, tmp_path, client):
    def scores(body):  # each completion's score: its place in the request, so the order shows
        return 200, {"scores": [i + 0.5 for i in range(len(body["completions"]))]}

    with JudgeServer(scores) as judge:
        cfg = replace(
            _cfg(keys, redis_url, tmp_path, judge.url + "/score", kind="batch"), producer={"max_groups": 3}
        )
        task, sampler = build(cfg)
        p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        assert p.run() == 0 and p.published == 3
    assert len(judge.requests) == 3 and judge.paths == ["/v1/score"] * 3, "one request a group"
    for (_, fields), request in zip(client.xrange(keys.traj), judge.requests, strict=True):
        group = decode(fields[b"d"], TrajectoryGroup)
        assert request["row"] == task.rows[group.row] and len(request["completions"]) == 2
        assert [s.reward for s in group.samples] == [0.5, 1.5]


def test_a_producer_keeps_one_pooled_client_for_the_judge_and_closes_it_when_it_stops(
    keys, redis_url, tmp_path, client
):
    from producers.judge import Judge

    with JudgeServer(lambda body: chat("1")) as judge:
        cfg = replace(_cfg(keys, redis_url, tmp_path, judge.url), producer={"max_groups": 4})
        task, sampler = build(cfg)
        assert isinstance(task.reward_fn, Judge) and task.reward_fn.concurrency == cfg.reward.concurrency
        p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        assert p.run() == 0 and p.published == 4
        assert len(judge.requests) == 4 * 2
        assert len(judge.ports) <= 2, f"{len(judge.ports)} connections for 8 requests: not kept alive"
        assert task.reward_fn._http is None, "the client is closed with the producer's loop"
        wait_until(
            lambda: judge.httpd.open == 0, timeout=10, what="the producer to close its judge connections"
        )
        assert p.step() == "published", "a closed judge makes a new client in the next loop"
    assert len(judge.requests) == 5 * 2


@pytest.mark.parametrize("failure", ["503", "unreachable", "slow"])
def test_judge_that_fails_is_an_outage_the_row_goes_back_uncounted(
    keys, redis_url, tmp_path, client, failure
):
    with JudgeServer(lambda body: (503, b"overloaded"), hang=failure == "slow") as judge:
        url = judge.url
        cfg = _cfg(keys, redis_url, tmp_path, url, retries=1, timeout=0.3)
        task, sampler = build(cfg)
        if failure == "unreachable":
            judge.__exit__()  # nothing listens on that port any more
        p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        p.stop.set()  # no outage backoff in the test
        assert p.step() == "error"
    if failure != "unreachable":
        # the G requests start at once; the first to give up (after its one retry) cancels
        # the others, wherever they are: between G + 1 and 2 G requests reach the judge
        assert 2 + 1 <= len(judge.requests) <= 2 * 2, judge.requests
    assert client.hlen(keys.row_attempts) == 0, "an outage is not one of the row's attempts"
    assert client.lrange(keys.requeue, 0, -1) == [b"0"] and client.xlen(keys.traj) == 0


@pytest.mark.parametrize(
    "kind, reply, says",
    [
        ("chat", chat("The response looks right to me."), "the judge's reply has no number: 'The response"),
        ("chat", chat("NaN"), "the judge's reply has no number: 'NaN'"),
        ("chat", (200, b"<html>" + b"x" * 500), "is not a chat completion: '<html>xxx"),
        ("score", (200, {"score": "high"}), 'is not {"score": <finite number>}: \'{"score": "high"}\''),
        ("batch", (200, {"scores": [1]}), 'is not {"scores": [<2 finite numbers>]}: \'{"scores": [1]}\''),
        ("batch", (200, {"scores": [1, None]}), 'is not {"scores": [<2 finite numbers>]}'),
    ],
)
def test_judge_that_answers_without_a_number_dead_letters_the_row_with_the_reply_quoted(
    keys, redis_url, tmp_path, client, kind, reply, says
):
    with JudgeServer(lambda body: reply) as judge:
        url = judge.url if kind == "chat" else judge.url + "/score"
        cfg = _cfg(keys, redis_url, tmp_path, url, attempts=1, kind=kind)
        task, sampler = build(cfg)
        p = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        assert p.step() == "failed" and p.step() == "failed"  # the second claim skips the row
    if kind == "score":
        assert judge.requests[0]["completion"] is not None and judge.requests[0]["row"] in task.rows
    if kind == "batch":
        assert len(judge.requests) == 2, "one request a group"
        assert len(judge.requests[0]["completions"]) == 2 and judge.requests[0]["row"] in task.rows
    skipped = client.hgetall(keys.skipped_rows)
    assert list(skipped) == [b"0"] and says in skipped[b"0"].decode()
    assert len(skipped[b"0"]) < 500, "the quote is truncated"
    p.trips.flush_metrics()
    assert counters(client, keys)["episodes_dropped_bad_reward"] >= 2 and client.xlen(keys.traj) == 0


def test_judge_config_errors_name_the_key_or_the_row_before_anything_runs(keys, redis_url, tmp_path):
    with pytest.raises(
        ConfigError, match=r"key `reward.judge.url`: required when `producer.reward` = \"judge\""
    ):
        replace(RunConfig(), producer={"reward": "judge"})
    cfg = _cfg(keys, redis_url, tmp_path, "http://127.0.0.1:9/v1", template="{difficulty}: {completion}")
    with pytest.raises(
        DatasetError, match=r"row 0 \(and \d+ more\) has no `difficulty`, which the reward judge"
    ):
        build(cfg)
    cfg = _cfg(keys, redis_url, tmp_path, "http://127.0.0.1:9/v1", api_key_env="STREAMER_TEST_NO_SUCH_KEY")
    with pytest.raises(ConfigError, match=r"\$STREAMER_TEST_NO_SUCH_KEY is not set"):
        build(cfg)


@pytest.mark.parametrize("kind", ["chat", "batch"])
def test_judge_scores_the_evaluators_sets_too(keys, redis_url, tmp_path, client, kind):
    from producers import eval_sets
    from producers.components import load_task, local_sampler
    from producers.evaluator import Evaluator
    from producers.judge import Judge
    from streamer import models

    def reply(body):
        return chat("0.25") if kind == "chat" else (200, {"scores": [0.25] * len(body["completions"])})

    with JudgeServer(reply) as judge:
        url = judge.url if kind == "chat" else judge.url + "/score"
        cfg = replace(
            _cfg(keys, redis_url, tmp_path, url, kind=kind),
            eval={"max_rows": 3, "batch_size": 3, "max_new_tokens": 2, "max_versions": 1},
        )
        (default,) = eval_sets.prepare(cfg)  # checked before anything runs
        assert isinstance(default.reward_fn, Judge) and default.reward_path == "judge"
        tok = models.load_tokenizer(cfg.model)
        sampler, stops = local_sampler(cfg, tok)
        task = load_task(cfg, dataset="demo", split="eval", tokenizer=tok, extra_stop_ids=stops)
        assert Evaluator(cfg, client=client, task=task, sampler=sampler).run() == 0
    (event,) = [decode(f[b"d"], MetricsEvent) for _, f in client.xrange(keys.metrics)]
    assert event.values["reward_mean"] == 0.25 and len(judge.requests) == 3


def _judge(url: str, **judge):
    from producers.judge import Judge
    from streamer.config_rollout import JudgeSection

    return Judge(JudgeSection(url=url, model="judge-1", retries=0, **judge), concurrency=4)


def _scores(judge, calls: int) -> list[float]:
    """``calls`` judge calls one after another in one event loop, then the judge closed."""

    async def main():
        try:
            return [await judge(ROW, "5") for _ in range(calls)]
        finally:
            await judge.aclose()

    return anyio.run(main)


def test_a_batch_judge_asked_for_one_completion_sends_a_batch_of_one():
    with JudgeServer(lambda body: (200, [0.5] * len(body["completions"]))) as server:  # a bare list
        assert _scores(_judge(server.url + "/score", kind="batch"), 2) == [0.5, 0.5]
    assert [r["completions"] for r in server.requests] == [["5"], ["5"]]


@pytest.mark.parametrize("closes", ["after_reply", "on_next_request"])
def test_a_pooled_connection_the_judge_closed_is_replaced_not_an_outage(closes):
    """A judge that closes a keep-alive connection (its idle timeout) without saying so: the
    client sees the end of file on the idle socket, or, closed as the next request arrives,
    sends that request once more on a new connection. No retry is configured: none is used."""

    class Server(JudgeServer):
        def __init__(self):
            super().__init__(lambda body: chat("0.5"))
            self.unanswered = 0
            handler = self.httpd.RequestHandlerClass
            server = self

            class Closing(handler):
                answered = False

                def do_POST(self):
                    if self.answered and closes == "on_next_request":
                        self.rfile.read(int(self.headers["Content-Length"]))
                        server.unanswered += 1
                        self.close_connection = True  # read, never answered
                        return
                    super().do_POST()
                    self.answered = True
                    self.close_connection = closes == "after_reply"  # no "Connection: close" sent

            self.httpd.RequestHandlerClass = Closing

    with Server() as judge:
        assert _scores(_judge(judge.url), 3) == [0.5, 0.5, 0.5]
    assert len(judge.requests) == 3 and len(judge.ports) == 3
    if closes == "on_next_request":
        assert judge.unanswered == 2, "each reused connection was closed as it was asked"


def _self_signed(tmp_path):
    """A certificate for localhost and 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "judge.pem", tmp_path / "judge.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


def test_judge_over_https_keeps_its_connection_and_verifies_the_server(tmp_path, monkeypatch):
    import ssl

    cert_file, key_file = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert_file, key_file)
    with JudgeServer(lambda body: chat("Score: 0.75")) as judge:
        judge.httpd.socket = tls.wrap_socket(judge.httpd.socket, server_side=True)
        url = f"https://localhost:{judge.httpd.server_address[1]}/v1"  # the name the certificate has
        with pytest.raises(RewardUnavailable, match="cannot be reached: .*CERTIFICATE_VERIFY_FAILED"):
            _scores(_judge(url), 1)  # certifi's roots do not know this certificate
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))
        assert _scores(_judge(url), 3) == [0.75, 0.75, 0.75]
    assert len(judge.requests) == 3 and len(judge.ports) == 1, "one kept-alive TLS connection"


def test_judge_url_must_be_http_or_https():
    for url in ("judge.local:8000/v1", "ftp://judge.local/v1", "https://user:key@judge.local/v1"):
        with pytest.raises(ConfigError, match=r"`reward.judge.url` = .*: give http\(s\)://host"):
            _judge(url)


def test_judge_goes_through_the_environments_proxy(monkeypatch):
    """HTTP_PROXY is used, NO_PROXY respected: the stub stands in for the proxy and sees the
    judge's absolute URL."""
    with JudgeServer(lambda body: chat("0.25")) as proxy:
        monkeypatch.setenv("http_proxy", proxy.url.removesuffix("/v1"))
        monkeypatch.setenv("no_proxy", "")
        assert _scores(_judge("http://judge.invalid:8000/v1"), 2) == [0.25, 0.25]
        assert proxy.paths == ["http://judge.invalid:8000/v1/chat/completions"] * 2
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        assert _scores(_judge(proxy.url), 1) == [0.25]  # dialled directly
        assert proxy.paths[-1] == "/v1/chat/completions"
