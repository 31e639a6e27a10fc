"""A real HF model directory (Qwen2 architecture, a byte-level BPE tokenizer trained in
code, a chat template with tool calls), loaded through the same ``from_pretrained`` path a
hub id takes: multi-turn tool rendering round-trips through the assembler with no prefix
mismatch, and re-rendering the history (which re-tokenizes a sampled turn) is caught."""

from __future__ import annotations

import json

import pytest

from producers.episodes import to_sample
from producers.render import Renderer
from producers.samplers import LocalSampler
from streamer import demo, models
from streamer.config import ModelSection
from streamer.rollout.contract import Completion
from streamer.rollout.trajectory import PrefixMismatch, Trajectory

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] -%}"
    '{{ \'<tool_call>{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{ tc.function.arguments | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CORPUS = [
    "What is 17 times 23? Use the calculator.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>',
    "<tool_response>391</tool_response> The answer is 391.",
    "user assistant system tool_call tool_response name arguments expression",
] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = TEMPLATE
    # a one-layer model of the demo's shape, over this tokenizer's vocabulary and special tokens
    config = demo.model_config(hidden=32, layers=1, heads=2, intermediate=64)
    config.update({"vocab_size": len(fast), "max_position_embeddings": 256, "num_key_value_heads": 1})
    config.update({"eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id})
    directory = tmp_path_factory.mktemp("qwen2-bpe")
    Qwen2ForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def _sampled(tok, text: str, version: int = 0) -> Completion:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Completion(ids, [-0.1] * len(ids), "stop", version=version)


CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}
CALL_TEXT = (
    '<tool_call>{"name": "calculator", "arguments": '
    + json.dumps(CALL["function"]["arguments"])
    + "}</tool_call>"
)


def test_multi_turn_tool_rendering_round_trips_through_the_assembler(model_dir):
    cfg = ModelSection(name_or_path=str(model_dir))
    tok = models.load_tokenizer(cfg)  # AutoTokenizer.from_pretrained, as for a hub id
    model = models.load_model(cfg, dev="cpu")
    renderer = Renderer(tok)
    row = {"messages": [{"role": "user", "content": "What is 17 times 23? Use the calculator."}]}
    t = Trajectory(renderer.render(row))
    sampler = LocalSampler(model, stop_ids=renderer.stop_ids, pad_id=tok.pad_token_id)
    (real,) = sampler.sample(t.next_prompt(), n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    assert real.token_ids and max(real.token_ids) < len(tok)  # the model samples in this vocabulary
    t.extend(t.next_prompt(), _sampled(tok, CALL_TEXT, version=0))  # turn 1: the tool call
    t.append_messages(renderer, [{"role": "tool", "content": "391"}])  # weight 0
    t.extend(t.next_prompt(), _sampled(tok, "The answer is 391.", version=1))  # turn 2
    history = [
        *row["messages"],
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": "The answer is 391."},
    ]
    full = tok.apply_chat_template(history, tokenize=False)
    assert tok.decode(t.tokens) == full.removesuffix("\n"), "the trajectory is the conversation, token-exact"
    sample = to_sample(t.episode(1.0, tool_calls=1), vocab_size=len(tok))
    mask, versions = sample.loss_mask(), sample.token_versions()
    tool_start = len(_sampled(tok, CALL_TEXT).token_ids)
    tool_len = len(renderer.render_suffix([{"role": "tool", "content": "391"}]))
    assert mask[tool_start : tool_start + tool_len].sum() == 0, "the tool's tokens are not trained"
    assert set(versions[mask > 0].tolist()) == {0, 1} and sample.version == 0


def test_re_rendering_the_history_is_caught_as_a_prefix_mismatch(model_dir):
    tok = models.load_tokenizer(ModelSection(name_or_path=str(model_dir)))
    renderer = Renderer(tok)
    row = {"messages": [{"role": "user", "content": "What is 17 times 23? Use the calculator."}]}
    t = Trajectory(renderer.render(row))
    # the model sampled the tool call one character at a time: valid tokens, but not the
    # merges the tokenizer picks when it re-encodes the same text
    canonical = tok.encode(CALL_TEXT, add_special_tokens=False)
    per_char = [tok.convert_tokens_to_ids(c) for piece in tok.convert_ids_to_tokens(canonical) for c in piece]
    assert len(per_char) > len(canonical) and tok.decode(per_char) == CALL_TEXT
    ids = per_char + [tok.eos_token_id]
    t.extend(t.next_prompt(), Completion(ids, [-0.1] * len(ids), "stop", version=0))
    rerendered = tok.apply_chat_template(
        [
            *row["messages"],
            {"role": "assistant", "content": CALL_TEXT},
            {"role": "tool", "content": "391"},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    with pytest.raises(PrefixMismatch) as e:
        t.extend(rerendered, _sampled(tok, "391", version=0))
    start = len(renderer.render(row))
    first_merge = next(i for i, (a, b) in enumerate(zip(per_char, rerendered[start:])) if a != b)
    assert e.value.index == start + first_merge
    assert t.next_prompt() == renderer.render(row) + ids, "nothing was folded in"


def test_an_openai_agent_with_tools_round_trips_through_the_proxy(model_dir):
    """The agent sees ``tool_calls`` parsed from the sampled text and sends them back as
    OpenAI messages; the proxy re-renders them with the template and the history still
    extends the sampled tokens: one chain, the tool's tokens at weight 0."""
    import anyio
    import openai

    from producers.proxy import proxied
    from streamer.rollout.contract import RolloutContext, Task

    tok = models.load_tokenizer(ModelSection(name_or_path=str(model_dir)))
    renderer = Renderer(tok)
    replies = iter([CALL_TEXT, "The answer is 391."])

    async def sample_fn(prompt_ids, **kwargs):
        return [_sampled(tok, next(replies), version=7)]

    ctx = RolloutContext(Task([], renderer, None, ""), 1, 1.0, 1.0, 64, 0, sample_fn)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    @proxied
    async def agent(row, endpoint):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        history = list(row["messages"])
        async with client:
            reply = await client.chat.completions.create(model="m", messages=history, tools=tools)
            (call,) = reply.choices[0].message.tool_calls
            assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
            history.append(reply.choices[0].message.model_dump(exclude_none=True))
            history.append({"role": "tool", "tool_call_id": call.id, "content": "391"})
            reply = await client.chat.completions.create(model="m", messages=history, tools=tools)
        return float("391" in reply.choices[0].message.content)

    row = {"messages": [{"role": "user", "content": "What is 17 times 23? Use the calculator."}]}
    (ep,) = anyio.run(agent, row, ctx)
    assert ep.reward == 1.0 and ep.metrics["turns"] == 2 and ep.metrics["proxy_divergences"] == 0
    sample = to_sample(ep, vocab_size=len(tok))
    tool = renderer.render_suffix([{"role": "tool", "content": "391"}])
    context = [s.tokens for s in ep.segments if not s.sampled]
    assert context == [renderer.render(row), tool] and sample.loss_mask().sum() == sum(
        len(s.tokens) for s in ep.segments if s.sampled
    )
