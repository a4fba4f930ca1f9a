"""The math reward: extract a completion's final answer and compare it with math-verify.

`math_verify_reward(completion, ground_truth)` returns 1.0 when the final answer (the last
\\boxed{...} if there is one, otherwise the last LaTeX or plain expression) is mathematically
equivalent to the ground truth (1/2 == \\frac{1}{2} == 0.5), else 0.0; anything that fails to
parse scores 0.0. math-verify can hang on pathological input: score batches through
`vespo.rewards.RewardScorer(math_verify_reward, timeout_s=...)`, which runs each call in a
worker process and kills it at the time limit.
"""

from __future__ import annotations

import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

INNER_TIMEOUT_S = 5  # math-verify's own signal-based limit, usable only on a main thread
_GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def _inner_timeout() -> int | None:
    """math-verify's signal alarm works on the main thread only; elsewhere the caller bounds time."""
    return INNER_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def gold_answer_text(ground_truth: Any) -> str:
    """The ground truth as LaTeX math-verify parses: a bare answer is wrapped in \\boxed{}."""
    text = str(ground_truth).strip()
    return text if "\\boxed" in text else f"\\boxed{{{text}}}"


def last_boxed(text: str) -> str | None:
    """The last "\\boxed{...}" of `text` with its braces balanced, or None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start : end + 1]
    return None  # unbalanced: no complete final answer


def final_answer_text(completion: str) -> str:
    """What math-verify parses: the last complete \\boxed{...}, else the whole completion."""
    boxed = last_boxed(completion)
    return completion if boxed is None else boxed


def math_verify_reward(completion: str, ground_truth: Any) -> float:
    """1.0 iff the completion's final answer is equivalent to `ground_truth` (normalization is
    math-verify's: LaTeX is parsed to sympy, \\boxed{} answers take priority, numbers compare
    to 6 decimal places, so "0.5", "1/2" and "\\frac{1}{2}" agree); else 0.0, parse errors included."""
    timeout = _inner_timeout()
    try:
        gold = parse(gold_answer_text(ground_truth), extraction_config=_GOLD_CONFIG, parsing_timeout=timeout)
        pred = parse(final_answer_text(completion), extraction_config=_PRED_CONFIG, parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # math-verify's parse and verify errors (and its own timeouts) score 0
        return 0.0
