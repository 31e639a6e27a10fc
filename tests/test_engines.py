"""Engine profiles (producers/engines.py) and what producers do when the engine misbehaves,
against the project's OpenAI-compatible test server; the same calls against a real vLLM are
tests/test_vllm.py's."""

from __future__ import annotations

import logging
import threading

import pytest
from trainer_data import EOS
from waits import wait_until

from producers import engines
from producers.components import build
from producers.fake_server import FakeCompletionsServer, canned
from producers.follow import WeightFollower
from producers.producer import Producer
from producers.remote_sampler import RemoteSampler
from schemas import WeightSync
from streamer import demo, tensorfile, weights
from streamer.bus import entry
from streamer.config import ConfigError, RunConfig, parse_config, replace
from streamer.readmodel import snapshot


def _sampler(server, engine: engines.Engine) -> RemoteSampler:
    return RemoteSampler(base_url=server.url, model="m", stop_ids=[EOS], engine=engine, retries=0)


def _publish(client, keys, root, version: int) -> None:
    uri, sha = weights.write_version(demo.build_model(seed=version), root, version)
    client.xadd(keys.policy, entry(WeightSync(version=version, step=version, uri=uri, sha256=sha)))


@pytest.mark.parametrize(
    ("name", "overrides", "calls"),
    [
        (
            "vllm",
            {},
            [
                "/pause?mode=wait",
                "/collective_rpc",
                "/reset_prefix_cache?reset_running_requests=false",
                "/resume",
            ],
        ),
        ("sglang", {}, ["/update_weights_from_disk", "/continue_generation"]),
        ("openai", {"reload_endpoint": "/update_weights_from_disk"}, ["/update_weights_from_disk"]),
    ],
)
def test_each_engine_profile_sends_its_reload_call(client, keys, tmp_path, name, overrides, calls):
    with FakeCompletionsServer(canned([4, EOS])) as server:
        sampler = _sampler(server, engines.profile(name, **overrides))
        follower = WeightFollower(client, keys, weights_dir=tmp_path, sampler=sampler)
        _publish(client, keys, tmp_path, 1)
        assert follower.update() and follower.version == 1
        assert server.reloads == [str(weights.version_dir(tmp_path, 1).resolve())]
        assert server.paths == calls
        sampler.close()


def test_a_plain_openai_server_cannot_follow_versions_and_says_so(client, keys, tmp_path, caplog):
    with FakeCompletionsServer(canned([4, EOS])) as server, caplog.at_level(logging.WARNING):
        sampler = _sampler(server, engines.profile("openai"))
        follower = WeightFollower(client, keys, weights_dir=tmp_path, sampler=sampler)
        _publish(client, keys, tmp_path, 1)
        assert not follower.update() and follower.version == 0 and follower.errors == 0
        assert server.paths == [] and "cannot load new weights" in caplog.text
        sampler.close()


def test_engine_keys_and_their_defaults():
    cfg = parse_config(b'[producer]\nsampler = "remote"\nremote_url = "http://x"\n')
    assert cfg.producer.engine == "vllm" and cfg.producer.logprobs_mode == "raw"
    assert cfg.producer.untied_versions  # vLLM reloads a tied head from nothing
    sglang = parse_config(b'[producer]\nengine = "sglang"\nsampler = "remote"\nremote_url = "http://x"\n')
    assert sglang.producer.logprobs_mode == "processed" and not sglang.producer.untied_versions
    with pytest.raises(ConfigError, match="producer.engine"):
        parse_config(b'[producer]\nengine = "tgi"\n')


@pytest.mark.parametrize(
    "key", ["trainer.lr", "trainer.grad_clip", "producer.temperature", "bus.socket_timeout"]
)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_setting_is_a_config_error_naming_the_key(key, value):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(f"[{section}]\n{name} = {value}\n".encode())


def test_an_engine_that_goes_down_is_waited_out_and_nothing_is_lost(client, keys, redis_url, tmp_path):
    """The engine answers 503 for a while (down or restarting): rows are handed back without
    counting against them, status names the engine, and the producer carries on afterwards."""
    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 2, "max_new_tokens": 2, "max_groups": 6, "remote_retries": 0},
        trainer={"groups_per_step": 1000},
    )
    answer, calls = canned([10, EOS]), []

    def backend(body):  # the probe and two groups, then down until the test says otherwise
        calls.append(1)
        if len(calls) == 3:
            server.fail_next(1_000_000, status=503)
        return answer(body)

    with FakeCompletionsServer(backend) as server:
        cfg = replace(cfg, producer={"sampler": "remote", "remote_url": server.url})
        task, sampler = build(cfg)
        producer = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        done = threading.Thread(target=producer.run, daemon=True)
        done.start()
        snap = wait_until(
            lambda: (s := snapshot(client, keys)).problems and s,
            timeout=60,
            what="status to name the engine",
        )
        assert any("engine down" in what for what in snap.problems.values()), snap.problems
        wait_until(lambda: producer.outages.failures >= 2, timeout=60, what="two failed tries")
        server.clear_failures()
        done.join(120)
        assert not done.is_alive(), "the producer did not finish after the engine came back"
    assert producer.published == 6
    assert not client.hlen(keys.row_attempts), "an engine outage was charged to the rows"
    assert not snapshot(client, keys).problems  # cleared once it published again


def test_the_trainer_never_publishes_non_finite_weights(client, keys, tmp_path):
    import torch

    from consumers.versions import VersionPublisher
    from streamer.errors import StreamerError

    publisher = VersionPublisher(client, keys, root=tmp_path, keep_versions=3, protect=lambda: -1)
    model = demo.build_model(seed=1)
    publisher.publish_now(model, version=0, step=0)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    publisher.submit(model, version=1, step=1)
    with pytest.raises(StreamerError, match=r"step 1 produced non-finite weights .*up_proj"):
        publisher.drain()
    publisher.abandon()
    assert client.xlen(keys.policy) == 1 and int(client.get(keys.version)) == 0
    assert weights.versions(tmp_path) == [0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_versions_are_written_in_model_dtype_and_load_into_a_sampler_of_it(tmp_path, dtype):
    import torch

    from producers.samplers import LocalSampler

    trained = demo.build_model(seed=3)  # the trainer's float32 master weights
    weights.write_version(trained, tmp_path, 1, dtype=getattr(torch, dtype))
    vdir = weights.version_dir(tmp_path, 1)
    head, _ = tensorfile.header(vdir / weights.WEIGHTS_FILE)
    assert {spec["dtype"] for spec in head.values()} == {"BF16" if dtype == "bfloat16" else "F16"}
    sampler_model = demo.build_model(seed=0).to(getattr(torch, dtype))
    LocalSampler(sampler_model, stop_ids=[EOS]).load_weights(vdir)
    want = {k: v.to(getattr(torch, dtype)) for k, v in trained.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in sampler_model.state_dict().items())
    # a float32 file loads into a half-precision model too (cast as it is copied)
    weights.write_version(trained, tmp_path, 2)
    LocalSampler(demo.build_model(seed=0).to(getattr(torch, dtype)), stop_ids=[EOS]).load_weights(
        weights.version_dir(tmp_path, 2)
    )


def test_a_model_the_engine_refuses_stops_the_producer_at_start_with_the_reason(
    client, keys, redis_url, tmp_path
):
    """vLLM answers a model its CPU backend cannot run with HTTP 500 at the first completion
    (its /health said 200): the producer says so before any row is claimed."""
    from streamer.errors import SamplerError

    cfg = replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": 2, "max_new_tokens": 2},
        trainer={"groups_per_step": 1000},
    )
    with FakeCompletionsServer(canned([10, EOS])) as server:
        cfg = replace(cfg, producer={"sampler": "remote", "remote_url": server.url})
        task, sampler = build(cfg)
        producer = Producer(cfg, client=client, producer_id="p", task=task, sampler=sampler)
        server.fail_next(1, status=500)
        with pytest.raises(SamplerError, match="refused a first completion: HTTP 500") as err:
            producer.run()
        assert err.value.refused and server.requests == 1
    assert not client.exists(keys.cursor), "a row was claimed"
    assert "refused a first completion" in " ".join(snapshot(client, keys).problems.values())


def test_the_trainer_warns_once_when_engine_logprobs_disagree_on_fresh_data(caplog):
    from types import SimpleNamespace

    from consumers import trainer

    fake = SimpleNamespace(_mismatch_warned=False, step=3)
    with caplog.at_level(logging.WARNING, logger="consumers.trainer"):
        trainer.Trainer._check_mismatch(fake, {"mismatch_kl": 0.5, "staleness_max": 1.0})  # stale: not judged
        assert not caplog.text
        for _ in range(3):
            trainer.Trainer._check_mismatch(fake, {"mismatch_kl": 0.5, "staleness_max": 0.0})
    assert caplog.text.count("disagree with the trainer's on fresh data: mismatch_kl 0.5 at step 3") == 1


def test_an_engine_answer_over_the_size_limit_is_refused_not_read(tmp_path):
    """A completions answer larger than producer.max_reply_bytes is refused as it streams in
    (the row's request, charged to it), never held whole in memory."""
    from streamer.errors import SamplerError

    with FakeCompletionsServer(canned([4] * 2000 + [EOS])) as server:
        sampler = RemoteSampler(
            base_url=server.url,
            model="m",
            stop_ids=[EOS],
            engine=engines.Vllm(),
            retries=0,
            max_reply_bytes=4096,
        )
        with pytest.raises(SamplerError, match="max_reply_bytes") as err:
            sampler.sample([1, 2, 3], n=2, temperature=1.0, top_p=1.0, max_new_tokens=2001)
        assert err.value.refused
        sampler.close()
