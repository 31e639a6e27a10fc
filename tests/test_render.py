"""Rendering: chat template with the generation prompt, plain prompts on request, stop ids."""

from __future__ import annotations

import copy

import pytest

from producers.render import Renderer, stop_ids
from streamer import demo
from streamer.errors import ConfigError


@pytest.fixture
def tok():
    return demo.tokenizer()


def test_chat_template_adds_the_generation_prompt(tok):
    r = Renderer(tok)
    ids = r.render({"messages": [{"role": "user", "content": "3+4="}]})
    assert tok.decode(ids) == "<|user|>3+4=<|end|><|assistant|>"
    assert r.render({"prompt": "3+4="}) == ids  # a prompt string is one user turn


def test_stop_ids_come_from_the_tokenizer(tok):
    r = Renderer(tok, extra_stop_ids=[5, 7])
    assert r.stop_ids == [tok.eos_token_id, 7]  # EOS first, no duplicates
    assert stop_ids(tok, None) == [tok.eos_token_id] and stop_ids(tok, 9) == [5, 9]
    assert r.decode([10, 11, tok.eos_token_id]) == "45"  # EOS is not part of the reward's text


def test_no_chat_template_is_a_clear_error_unless_plain_prompts_are_asked_for(tok):
    plain_tok = copy.deepcopy(tok)
    plain_tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template.*model.chat_template = false"):
        Renderer(plain_tok)
    r = Renderer(plain_tok, chat_template=False)
    assert plain_tok.decode(r.render({"prompt": "1+2="})) == "1+2="
    chat = {"messages": [{"role": "system", "content": "1"}, {"role": "user", "content": "2"}]}
    assert r.render(chat) == plain_tok("1\n2")["input_ids"]


def test_a_tokenizer_without_eos_is_refused(tok):
    no_eos = copy.deepcopy(tok)
    no_eos.eos_token = None
    with pytest.raises(ConfigError, match="no EOS"):
        Renderer(no_eos)
