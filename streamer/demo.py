"""The built-in demo task: single-digit addition, learnable by RL on 2 CPU cores.

A prompt is ``a+b=`` with ``a + b <= 9`` (a user turn rendered with a chat template, 55
prompts); the right answer is the digit ``a+b``. The tokenizer is built in code (one token
per character plus a few specials), the model is a tiny Qwen2 built from a config, so
nothing is downloaded. An untrained model answers at chance level or below; the reward is
1 when the completion starts with the right digit.

Why not ``(a+b) mod 10`` over all 100 pairs: a model this small sits on a long plateau on
that task even with supervised labels (~300 steps of batch 64 at chance before it
"groks" it), and from a ~0.1 chance reward, RL did not leave the plateau within the
minutes the demo has. Plain addition has structure a tiny model finds quickly.
"""

from __future__ import annotations

import functools

DEMO = "demo"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARS = list("0123456789+=")


# trainer steps of `streamer up` with no arguments. By ~500 the policy answers nearly every
# training prompt right in all 16 samples; those rows step aside (streamer/rows.py), and
# once every row has, the run ends by itself. The learning rate decays (cosine, to 0.1 of
# it) over these steps and then stays there (so `--steps 0` runs on): at a constant one,
# the last steps, spent on the few rows still learnable, pull held-out accuracy back down.
STEPS = 500


def config():
    """The run config of the demo: what `streamer up` (and every role) uses with no --config."""
    from streamer.config import RunConfig, replace

    return replace(
        RunConfig(),
        # 8 rows in flight: their groups share a generate (the micro-batcher), and over seeds
        # 0-5 the held-out 0.8 came in fewer versions than at 1 (docs/BENCHMARKS.md)
        producer={"group_size": 16, "max_new_tokens": 2, "reward": "streamer.demo:reward", "concurrency": 8},
        trainer={
            "steps": STEPS,
            "groups_per_step": 8,
            "lr": 5e-4,
            "lr_schedule": "cosine",
            "min_lr_ratio": 0.1,
            "lr_decay_steps": STEPS * 2,  # optimizer steps: 2 minibatches a step
            "max_staleness": 1,
            "ppo_minibatches": 2,
            "overlong": "keep",
            "checkpoint_every": 20,
        },
        eval={"eval_every": 10, "max_new_tokens": 2},
    )


# The pairs only the eval split has (10 of 55). Each has ``a > b``, so its mirror ``b+a`` is
# trained; each sums to 3 or more, so its answer is also the answer of at least three
# trained pairs; and every digit still starts and ends some trained prompt. A held-out
# ``1+0`` (its answer given by ``0+1`` alone) measures whether a tiny model keeps an answer
# it saw once, not whether it adds: a split holding it out had it wrong in 8 of 10 final
# models (docs/BENCHMARKS.md, the demo's learning curve).
HELD_OUT = frozenset({(2, 1), (3, 2), (4, 0), (4, 3), (5, 0), (5, 1), (5, 4), (6, 2), (7, 0), (8, 1)})


def held_out(a: int, b: int) -> bool:
    """Whether ``a+b=`` is one of the eval split's pairs (:data:`HELD_OUT`)."""
    return (a, b) in HELD_OUT


def rows(split: str = "train") -> list[dict]:
    """Dataset rows: (a, b) with a + b <= 9; "eval" is the 10 held-out pairs, "train" the rest."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown demo split {split!r}")
    return [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
        if a + b <= 9 and held_out(a, b) == (split == "eval")
    ]


def reward(row: dict, text: str, sample=None) -> float:
    """1.0 when the completion starts with the right digit, else 0.0."""
    return 1.0 if text.strip()[:1] == row["answer"] else 0.0


reward.required_fields = ("answer",)  # every row is checked for it before work starts


def _character_tokenizer():
    """One token per character plus the specials, as a plain ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


@functools.lru_cache(maxsize=1)
def decoder():
    """The demo's tokenizer for token ids -> text only (``decode(ids, skip_special_tokens=)``,
    as :func:`tokenizer` decodes), without importing transformers: what the archiver needs."""
    return _character_tokenizer()


@functools.lru_cache(maxsize=1)
def tokenizer():
    """A character-level PreTrainedTokenizerFast with a chat template; ``<|end|>`` is EOS."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_character_tokenizer(),
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|end|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 128,
    tie: bool = True,
    positions: int = 64,
):
    """A Qwen2 config for the demo vocabulary: ~100k parameters at the defaults."""
    from transformers import Qwen2Config

    tok = tokenizer()
    return Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )


# the demo model's shape for an engine (vLLM): CPU attention takes head sizes 32, 64, 80, ...
# only, and vLLM reloads a tied head from nothing (it stays at the start-up weights)
ENGINE_SIZE = {"hidden": 128, "heads": 2, "intermediate": 256}


def save_for_engine(directory, seed: int = 0, positions: int = 64):
    """The untrained demo model in the shape every engine accepts (:data:`ENGINE_SIZE`,
    untied, ``positions`` long), saved with the tokenizer as an HF directory an engine
    serves; the directory."""
    from pathlib import Path

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    model = build_model(seed, **ENGINE_SIZE, tie=False, positions=positions)
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer().save_pretrained(tmp)
    tmp.rename(directory)
    return directory


def build_model(seed: int = 0, **size):
    """The untrained demo model, deterministic for a seed; ``size``: :func:`model_config`'s."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model_config(**size))
