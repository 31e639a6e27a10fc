"""``producer.reward = "math"``: the completion's answer against the row's ``answer``, graded
with math-verify (fractions, decimals, expressions, sets, LaTeX ``\\boxed{}`` answers).

Both sides are parsed to SymPy and compared symbolically and numerically: ``\\boxed{1/2}``
matches ``0.5``, ``2x+1`` matches ``1+2x``. A text with LaTeX (``$...$``, ``\\(...\\)``,
``\\boxed{}``) yields its LaTeX answers and numbers; a bare short answer (one line, no
LaTeX, as a reference usually is) is read as one expression too. A GSM8K-style reference
is read after its last ``####``.

Failures, the same way :func:`producers.rewards.math_answer` fails:

- the completion has no answer, cannot be parsed, or its parsing or comparison runs past
  :data:`TIMEOUT_SECONDS`: reward 0.0 (the model's answer is wrong), the reason logged;
- the reference cannot be parsed: a ValueError, so the sample is dropped and logged (the
  row can never be graded; the row's attempts count it).

math-verify bounds a parse or a comparison with ``SIGALRM``, which only the main thread may
set; a producer scores in its main thread. Called from another thread, grading runs
unbounded (a rollout that scores in worker threads must bound it itself).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import threading

from producers.envs.needs import need

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 3  # per parse and per comparison (math-verify takes whole seconds)
BARE_CHARS = 100  # a text this short, on one line, without LaTeX, may be one expression
_LATEX = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")


def load():
    """The reward, once math-verify imports (a ConfigError naming the extra otherwise)."""
    need("math_verify", "math-verify", what='producer.reward = "math"')
    return math_verified


def math_verified(row: dict, text: str, sample=None) -> float:
    """1.0 when the completion's answer equals the row's ``answer`` mathematically, else 0.0."""
    from math_verify.errors import TimeoutException

    gold = _reference(str(row["answer"]))
    try:
        got = _parse(text)
    except TimeoutException:
        log.warning("math reward: parsing the completion ran past %ds (0.0)", TIMEOUT_SECONDS)
        return 0.0
    except Exception as e:  # a completion the parser chokes on is a wrong answer, not a failure
        log.debug("math reward: cannot parse the completion: %s: %s (0.0)", type(e).__name__, e)
        return 0.0
    if not got:
        log.debug("math reward: no answer in the completion (0.0)")
        return 0.0
    return 1.0 if _matches(gold, got) else 0.0


math_verified.required_fields = ("answer",)  # checked against every row before work starts


@functools.lru_cache(maxsize=4096)
def _reference(answer: str) -> tuple:
    """The parsed reference (cached: a row's G samples share it); ValueError if none."""
    from math_verify.errors import TimeoutException  # a BaseException: caught by name

    text = answer.rpartition("####")[2].strip() if "####" in answer else answer
    try:
        parsed = _parse(text)
    except (Exception, TimeoutException) as e:
        raise ValueError(f"reference answer {answer!r} cannot be parsed: {type(e).__name__}: {e}") from None
    if not parsed:
        raise ValueError(f"reference answer {answer!r} holds no answer math-verify can read")
    return tuple(parsed)


def _parse(text: str) -> list:
    """Every reading of ``text``: a bare answer as one expression first (the number
    extractor alone reads "2x+1" as 2), then its LaTeX answers and numbers."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    seconds, found = _timeout(), []
    bare = text.strip()
    if bare and len(bare) <= BARE_CHARS and "\n" not in bare and not _LATEX.search(bare):
        found += parse(f"${bare}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=seconds)
    both = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        found += parse(text, extraction_config=both, parsing_timeout=seconds, raise_on_error=True)
    except Exception:
        if not found:
            raise
    return found


def _matches(gold, got) -> bool:
    """Whether any reading of the reference equals any reading of the completion. A pair
    whose comparison fails is not a match; one that runs past the bound ends the grading
    (the other readings of the same expression would run as long): no match, logged."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for g, t in itertools.product(gold, got):
        try:
            if verify(g, t, timeout_seconds=_timeout(), raise_on_error=True):
                return True
        except TimeoutException:
            log.warning("math reward: a comparison ran past %ds (0.0)", TIMEOUT_SECONDS)
            return False
        except Exception as e:
            log.debug("math reward: a comparison failed: %s: %s (no match)", type(e).__name__, e)
    return False


def _timeout() -> int | None:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
