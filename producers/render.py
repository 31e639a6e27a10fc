"""Rendering: a dataset row -> prompt token ids, through the model's own tokenizer.

With ``model.chat_template = true`` (the default) the row's chat (or its ``prompt`` as a
single user turn) goes through ``tokenizer.apply_chat_template`` with the generation
prompt added, exactly as the model saw chats in training. A tokenizer without a chat
template is a :class:`ConfigError` unless the config asks for plain prompts
(``chat_template = false``): then the prompt text (or the chat's contents joined by
newlines) is tokenized as is, with the tokenizer's usual special tokens.

Stop tokens come from the tokenizer (its EOS) plus any extra EOS ids the model's
generation config lists; servers that want strings get them decoded.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamer.errors import ConfigError


class Renderer:
    def __init__(self, tokenizer, *, chat_template: bool = True, extra_stop_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if chat_template and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ConfigError(
                f"tokenizer {name!r} has no chat template; set `model.chat_template = false` "
                "to render plain prompts, or use a tokenizer that has one"
            )
        self.stop_ids = stop_ids(tokenizer, extra_stop_ids)
        if not self.stop_ids:
            raise ConfigError("the tokenizer has no EOS token: nothing would ever end a completion")

    def render(self, row: dict) -> list[int]:
        """Prompt token ids of ``row`` (a dict with ``messages`` or ``prompt``)."""
        if self.chat_template or "prompt" not in row:
            return self.render_messages(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
        return self._nonempty(self.tokenizer(row["prompt"])["input_ids"])

    def render_messages(self, messages: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids of a chat (and the tools it may call), generation prompt added."""
        if not self.chat_template:
            return self._nonempty(self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
        extra = {"tools": tools} if tools else {}
        return self._nonempty(self._apply(messages, add_generation_prompt=True, **extra))

    def _nonempty(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("the chat rendered to an empty prompt")
        return ids

    def render_suffix(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Tokens that ``messages`` add after an assistant turn that ended with a stop token.

        Multi-turn rollouts append these to the tokens accumulated so far instead of
        re-rendering the history (a re-render may tokenize a sampled turn differently).
        Found by rendering a fixed two-turn chat with and without ``messages``: the
        difference after the assistant's stop token is what the template appends.
        """
        if not self.chat_template:
            text = "".join(f"\n{m['content']}" for m in messages)
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self._apply(base, add_generation_prompt=False)
        after = self._apply(base + list(messages), add_generation_prompt=add_generation_prompt)
        stops = set(self.stop_ids)
        ends = [i for i, t in enumerate(before) if t in stops]
        if not ends:
            raise ValueError("the chat template does not end an assistant turn with a stop token")
        cut = ends[-1] + 1
        if after[:cut] != before[:cut]:
            raise ValueError("the chat template re-renders earlier turns when messages are added")
        return after[cut:]

    def _apply(self, messages: list[dict], *, add_generation_prompt: bool, **extra) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **extra
        )
        return [int(i) for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Completion text for rewards: special tokens (EOS) dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def stop_ids(tokenizer, extra: Iterable[int] = ()) -> list[int]:
    """EOS id(s) of the tokenizer, then ``extra`` (e.g. generation_config.eos_token_id)."""
    out: list[int] = []
    for i in [tokenizer.eos_token_id, *_as_list(extra)]:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


def _as_list(v) -> list:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return list(v)
