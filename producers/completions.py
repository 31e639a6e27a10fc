"""An engine's completions answer, untrusted, as :class:`Completion` s.

Completion token ids come back as ``choices[i].token_ids`` (vLLM >= 0.10.2 and SGLang with
``return_token_ids``); older vLLM only encodes them in ``choices[i].logprobs.tokens`` as
``"token_id:{id}"`` strings (``return_tokens_as_token_ids``), which is the fallback. The
log-prob of each sampled token is ``choices[i].logprobs.token_logprobs``. Both servers keep
the EOS token in ``token_ids`` when it ended the completion; it is cut after the first stop
id like the local sampler's. A streamed answer's chunks are joined per choice first
(:mod:`producers.streaming`) and checked the same way.
"""

from __future__ import annotations

from producers.samplers import Completion, SamplerError, cut_at_stop
from streamer.errors import EpisodeRejected

_TOKEN_PREFIX = "token_id:"
_INT32_MAX = 2**31 - 1


def parse_completions(data: dict, *, n: int, stop_ids: list[int]) -> list[Completion]:
    """The ``n`` choices of a completions answer as Completions (ordered by ``index``).

    The answer is untrusted: a server that answers without the fields asked for (no
    choices, no log-probs, no token ids) is a :class:`SamplerError`; a choice whose values
    cannot mean what they say (an id that is not an int32, a log-prob that is not a number)
    drops the rollout (:class:`EpisodeRejected`); the ids' vocabulary and the log-probs'
    range are checked with the episode (:func:`producers.episodes.to_sample`).
    """
    try:
        choices = data["choices"]
        if not all(isinstance(c, dict) for c in choices):
            raise TypeError
        choices = sorted(choices, key=lambda c: c.get("index", 0))
    except (KeyError, TypeError, AttributeError):
        raise SamplerError(f"answer has no `choices`: {str(data)[:200]}") from None
    if len(choices) != n:
        raise SamplerError(f"asked for {n} completions, got {len(choices)}")
    return [parse_choice(c, stop_ids) for c in choices]


def parse_choice(choice: dict, stop_ids: list[int]) -> Completion:
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if logprobs is None:
        raise SamplerError("choice has no logprobs.token_logprobs (was `logprobs` ignored?)")
    ids = choice.get("token_ids")
    if ids is None:
        tokens = lp.get("tokens") or []
        if not all(isinstance(t, str) and t.startswith(_TOKEN_PREFIX) for t in tokens):
            raise SamplerError(
                "choice has no token ids: the server needs `return_token_ids` (vLLM >= 0.10.2, "
                "SGLang) or `return_tokens_as_token_ids` (vLLM)"
            )
        ids = [_id_of(t[len(_TOKEN_PREFIX) :]) for t in tokens]
    if not isinstance(ids, list) or not isinstance(logprobs, list):
        raise EpisodeRejected("malformed", "the engine's token ids and log-probs must be lists")
    if len(ids) != len(logprobs) or any(p is None for p in logprobs):
        raise SamplerError(f"choice has {len(ids)} token ids but {len(logprobs)} log-probs")
    for i in ids:
        if type(i) is not int or not 0 <= i <= _INT32_MAX:
            raise EpisodeRejected("bad_token", f"the engine sent token id {i!r:.40}, not an int32 id")
    try:
        floats = [float(p) for p in logprobs if type(p) in (int, float)]
    except OverflowError:  # an int past float's range
        raise EpisodeRejected("bad_logprob", "the engine sent a log-prob past float's range") from None
    if len(floats) != len(logprobs):
        bad = next(p for p in logprobs if type(p) not in (int, float))
        raise EpisodeRejected("bad_logprob", f"the engine sent log-prob {bad!r:.40}, not a number")
    done = cut_at_stop(ids, floats, stop_ids)
    if done.finish_reason == "length" and choice.get("finish_reason") == "stop":
        # ended by a stop string or a stop token the server did not return: keep its verdict
        return Completion(done.token_ids, done.logprobs, "stop")
    return done


def _id_of(digits: str) -> int | str:
    """A ``token_id:{id}`` string's id (the text itself when it is not a plain number)."""
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 20 else digits
