"""Forked episodes: a chat template that drops earlier ``<think>`` blocks when the history is
rendered again breaks the token prefix; the episode goes on as a new piece, every piece is
token-exact, each sampled token is trained once, and the pieces share one advantage."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from producing import counters

from consumers import advantages
from consumers.batch import collate
from consumers.filters import GroupFilter
from producers.episodes import to_samples
from producers.producer import Producer
from producers.proxy import proxied
from producers.render import Renderer
from schemas import TrajectoryGroup, decode, encode
from streamer.config import RunConfig, TrainerSection, replace
from streamer.errors import EpisodeRejected, PrefixMismatch
from streamer.rollout.contract import Completion, Task, episodes
from streamer.rollout.trajectory import Trajectory

# Qwen3's rule, reduced: an assistant turn of the history keeps only what follows </think>
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROW = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}
REPLIES = ["<think>ab</think>5", "7", "<think>c</think>9"]  # turn 2 has no thinking block


@functools.lru_cache(maxsize=1)
def thinking_tokenizer():
    """A character-level tokenizer whose chat template strips earlier thinking blocks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = list("0123456789+=abc<>/thinks ")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>"
    )
    fast.chat_template = THINKING_TEMPLATE
    return fast


def _renderer() -> Renderer:
    return Renderer(thinking_tokenizer())


class Thinker:
    """A sampler that answers the k-th call of an episode with REPLIES[k] (+ the stop token)."""

    def __init__(self, renderer: Renderer, replies=REPLIES):
        self.renderer, self.replies = renderer, replies
        self.prompts: list[list[int]] = []

    def ids(self, k: int) -> list[int]:
        text = self.replies[k % len(self.replies)]
        return [*self.renderer.tokenizer.encode(text, add_special_tokens=False), self.renderer.stop_ids[0]]

    def sample(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=None):
        self.prompts.append(list(prompt_ids))
        ids = self.ids(self._turn(prompt_ids))[:max_new_tokens]
        return [Completion(ids, [-0.25] * len(ids), "stop") for _ in range(n)]

    def _turn(self, prompt_ids) -> int:  # turn k's prompt holds k user messages after the first
        user = self.renderer.tokenizer.convert_tokens_to_ids("<|user|>")
        return list(prompt_ids).count(user) - 1

    def load_weights(self, directory) -> None:
        raise AssertionError("no weights in these tests")

    def close(self) -> None:
        pass


def _history(renderer: Renderer, replies: list[str], user: str = "+") -> list[int]:
    """The whole conversation after ``replies``, rendered again (as an agent's client does)."""
    messages = list(ROW["messages"])
    for text in replies:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": user}]
    return renderer.render_messages(messages)


def _trained(samples) -> list[list[int]]:
    """The tokens each sample trains (weight 1), per sample."""
    return [s.completion_ids()[s.loss_mask() > 0].tolist() for s in samples]


def test_fork_a_rerendered_history_without_thinking_continues_as_a_new_token_exact_piece():
    r = _renderer()
    sampler = Thinker(r)

    def run(t: Trajectory) -> list[list[int]]:
        completions, texts = [], []
        for turn in range(3):
            prompt = _history(r, texts)
            (c,) = sampler.sample(prompt, n=1, temperature=1.0, top_p=1.0, max_new_tokens=32)
            t.extend(prompt, Completion(c.token_ids, c.logprobs, c.finish_reason, version=turn + 4))
            completions.append(c.token_ids)
            texts.append(r.decode(c.token_ids))
        return completions

    with pytest.raises(PrefixMismatch):  # the strict default
        run(Trajectory(r.render(ROW)))

    sampler.prompts.clear()
    t = Trajectory(r.render(ROW), fork=True)
    c1, c2, c3 = run(t)
    p1, p2, p3 = sampler.prompts[-3:]
    assert p2[: len(p1)] == p1 and p2[: len(p1 + c1)] != p1 + c1, "turn 2 dropped turn 1's thinking"
    assert p3[: len(p2 + c2)] == p2 + c2, "turn 2 had no thinking block: turn 3 extends its piece"
    ep = t.episode(1.0)
    samples = to_samples(ep, vocab_size=len(r.tokenizer), index=5)
    assert len(samples) == 2 and len(ep.forks) == 1 and ep.metrics["turns"] == 3
    first, last = samples
    assert first.token_ids().tolist() == p1 + c1 and first.prompt_len == len(p1), "piece 1, token-exact"
    assert last.token_ids().tolist() == p3 + c3 and last.prompt_len == len(p2), "piece 2, token-exact"
    assert first.token_versions().tolist() == [4] * len(c1)
    assert last.token_versions().tolist() == [5] * len(c2) + [-1] * (len(p3) - len(p2 + c2)) + [6] * len(c3)
    assert _trained(samples) == [c1, c2 + c3], "every sampled token trained once, in its own piece"
    assert sum(float(s.loss_mask().sum()) for s in samples) == len(c1 + c2 + c3)
    assert {s.episode for s in samples} == {5} and {s.reward for s in samples} == {1.0}


def test_fork_a_piece_over_max_seq_len_rejects_the_whole_episode_with_its_reason():
    r = _renderer()
    t = Trajectory(r.render(ROW), fork=True)
    c = Completion(r.tokenizer.encode("<think>ab</think>5", add_special_tokens=False), [-1.0] * 18, "stop", 0)
    t.extend(t.next_prompt(), c)
    longer = _history(r, ["5" * 30])  # breaks the prefix, and is long
    t.extend(longer, Completion([7], [-1.0], "stop", 0))
    ep = t.episode(0.0)
    assert len(to_samples(ep, vocab_size=len(r.tokenizer), max_seq_len=len(longer) + 1)) == 2
    with pytest.raises(EpisodeRejected, match=r"too_long: fork 2 of 2: \d+ tokens > max_seq_len"):
        to_samples(ep, vocab_size=len(r.tokenizer), max_seq_len=len(longer))


def _fork_group(rewards_of_pieces) -> TrajectoryGroup:
    from schemas import Sample

    samples = [
        Sample.build(
            prompt_ids=[1, 2],
            completion_ids=[3, 4],
            logprobs=[-1.0, -1.0],
            reward=reward,
            finish_reason="stop",
            version=0,
            episode=episode,
        )
        for episode, reward in rewards_of_pieces
    ]
    return TrajectoryGroup(
        group_id="g", row=0, epoch=0, producer_id="p", samples=samples, policy_version=0, created_at=0.0
    )


def test_fork_advantages_are_computed_over_episodes_and_shared_by_their_pieces():
    g = decode(encode(_fork_group([(0, 1.0), (0, 1.0), (0, 1.0), (1, 0.0), (2, 0.0)])), TrajectoryGroup)
    assert g.episode_index().tolist() == [0, 0, 0, 1, 2] and g.episode_rewards().tolist() == [1, 0, 0]
    adv = collate([g]).advantages.tolist()
    one = (1 - 1 / 3) / np.std([1.0, 0.0, 0.0])  # GRPO over the 3 episodes, not the 5 samples
    assert adv[:3] == pytest.approx([one] * 3) and adv[3:] == pytest.approx([-one / 2] * 2)
    for name in ("rloo", "dr_grpo"):
        fn = advantages.resolve(TrainerSection(advantage=name))
        expected = fn(torch.tensor([1.0, 0.0, 0.0]))[[0, 0, 0, 1, 2]]
        assert collate([g], advantage=fn).advantages.tolist() == pytest.approx(expected.tolist())
    with pytest.raises(ValueError, match="forks of episode 0 have different rewards"):
        _fork_group([(0, 1.0), (0, 0.0), (1, 0.0)])


def test_fork_pieces_of_one_episode_count_once_towards_min_group_size():
    judge = GroupFilter(max_staleness=1, min_group_size=2)
    assert judge(_fork_group([(0, 1.0), (0, 1.0), (1, 0.0)]), version=0).accepted
    assert judge(_fork_group([(0, 1.0), (0, 1.0)]), version=0).reason == "too_few_samples"


def _task(renderer: Renderer) -> Task:
    return Task([ROW], renderer, lambda row, text, sample=None: 1.0, "tests:one")


def _cfg(keys, redis_url, tmp_path, *, group_size: int = 3, max_seq_len: int = 0) -> RunConfig:
    return replace(
        RunConfig(),
        run={"name": keys.run, "redis_url": redis_url, "data_dir": str(tmp_path)},
        producer={"group_size": group_size, "min_group_size": 2, "max_new_tokens": 32},
        trainer={"groups_per_step": 1000, "max_seq_len": max_seq_len},
    )


def _published(client, keys) -> tuple[TrajectoryGroup, dict[str, float]]:
    (group,) = [decode(f[b"d"], TrajectoryGroup) for _, f in client.xrange(keys.traj)]
    return group, counters(client, keys)


def test_fork_through_the_proxy_trains_every_chain_once(keys, redis_url, tmp_path, client):
    """An agent re-sends its whole history, thinking included; the template strips it, so the
    call after a thinking turn starts a new chain. Both chains of each episode are published,
    token-exact, each sampled token at weight 1 in exactly one sample, one advantage each."""
    import openai

    r = _renderer()
    sampler = Thinker(r)
    order = iter(range(2))

    @proxied
    async def agent(row, endpoint):
        me = next(order)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        history = list(row["messages"])
        async with client:
            for _ in range(3):
                reply = await client.chat.completions.create(model="m", messages=history)
                history += [{"role": "assistant", "content": reply.choices[0].message.content}]
                history += [{"role": "user", "content": "+"}]
        return float(me == 0)

    cfg = _cfg(keys, redis_url, tmp_path, group_size=2)
    p = Producer(cfg, client=client, producer_id="p", task=_task(r), sampler=sampler, rollout=agent)
    assert p.step() == "published"
    group, counters = _published(client, keys)
    assert counters["episode_forks"] == 2 and counters["proxy_divergences"] == 2
    rewards = group.episode_rewards().tolist()
    assert [s.episode for s in group.samples] == [0, 0, 1, 1] and sorted(rewards) == [0, 1]
    first = r.render(ROW) + sampler.ids(0)
    last = _history(r, REPLIES[:2]) + sampler.ids(2)
    for a, b in (group.samples[0:2], group.samples[2:4]):
        assert a.token_ids().tolist() == first and a.prompt_len == len(r.render(ROW)), "chain 1, token-exact"
        assert b.token_ids().tolist() == last and b.prompt_len == len(_history(r, REPLIES[:1])), "chain 2"
        assert _trained([a, b]) == [sampler.ids(0), sampler.ids(1) + sampler.ids(2)], "each token once"
    adv = collate([group]).advantages.tolist()
    assert adv[0] == adv[1] == -adv[2] == -adv[3] and (adv[0] > 0) == (rewards[0] == 1), "one per episode"


def test_fork_whose_piece_exceeds_max_seq_len_drops_its_episode_with_the_reason(
    keys, redis_url, tmp_path, client
):
    @episodes
    async def rerenders(row, ctx, i):
        r = ctx.task.renderer
        t = Trajectory(r.render(row), fork=True)
        texts: list[str] = []
        for _ in range(3):
            prompt = _history(r, texts, user="+" * (40 if i == 1 else 1))
            (c,) = await ctx.sample(prompt)
            t.extend(prompt, c)
            texts.append(r.decode(c.token_ids))
        return t.episode(float(i == 0))

    r = _renderer()
    cfg = _cfg(keys, redis_url, tmp_path, max_seq_len=60)
    p = Producer(cfg, client=client, producer_id="p", task=_task(r), sampler=Thinker(r), rollout=rerenders)
    assert p.step() == "published"
    group, counters = _published(client, keys)
    assert counters["episodes_dropped_too_long"] == 1 and counters["sample_failures"] == 1
    assert [s.episode for s in group.samples] == [0, 0, 2, 2] and counters["episode_forks"] == 2
    assert max(s.num_tokens for s in group.samples) <= 60


def test_fork_pieces_come_back_from_a_rollout_service(keys, redis_url, tmp_path, client):

    from producers import httpd

    def episode(reward: float) -> dict:
        first = [{"tokens": [3, 8]}, {"tokens": [9, 5], "logprobs": [-0.2, -0.1], "version": 0}]
        last = [{"tokens": [3, 8, 5]}, {"tokens": [7], "logprobs": [-0.3], "version": 0}]
        return {"segments": last, "reward": reward, "forks": [first]}

    class Handler(httpd.JsonHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_json(200, {"episodes": [episode(1.0), episode(0.0)]})

    service = httpd.server(Handler)
    httpd.start(service)
    try:
        cfg = _cfg(keys, redis_url, tmp_path, group_size=2)
        cfg = replace(cfg, producer={"rollout": f"http://127.0.0.1:{service.server_address[1]}/rollout"})
        r = _renderer()
        p = Producer(cfg, client=client, producer_id="p", task=_task(r), sampler=Thinker(r))
        assert p.step() == "published"
    finally:
        service.shutdown()
        service.server_close()
    group, counters = _published(client, keys)
    assert [s.token_ids().tolist() for s in group.samples] == [[3, 8, 9, 5], [3, 8, 5, 7]] * 2
    assert [s.episode for s in group.samples] == [0, 0, 1, 1] and counters["episode_forks"] == 2


def test_fork_archive_records_the_trainers_advantages_and_each_pieces_prompt():
    from consumers.archive import advantage_of, record, trained_advantages

    g = _fork_group([(0, 1.0), (0, 1.0), (1, 0.0), (2, 0.0)])
    cfg = TrainerSection()
    archived = trained_advantages(g, GroupFilter.from_config(cfg)(g, version=0), advantage_of(cfg))
    assert archived == pytest.approx(collate([g]).advantages.tolist(), abs=1e-6)
    assert archived[0] == archived[1] != archived[2]
    entry = record("1-0", g, decode_text=str, verdict="accepted", advantages=archived, verdict_version=0)
    assert [c["episode"] for c in entry["completions"]] == [0, 0, 1, 2]
    assert entry["completions"][1]["prompt"] == "[1, 2]"
