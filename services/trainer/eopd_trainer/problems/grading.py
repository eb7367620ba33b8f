"""Answer extraction, grading and the pass@k estimator (pure functions).

Two extractions of a response's answer, both graded by math-verify against the gold answer and
both computed for every sample (`grade`); `eval.headline` names the one the headline metrics use:

- **strict** (`extract_boxed`): the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), braces
  balanced, or None. The format the prompts ask for; a response without a box is wrong.
- **flexible** (`extract_last_number`): the final number of the response, as lm-evaluation-harness's
  GSM8K `flexible-extract` filter does (regex `(-?[$0-9.,]{2,})|(-?[0-9]+)`, last match; its
  exact-match metric then drops `,` and `$` and a trailing `.`). So "1,234" -> 1234, "$5" -> 5,
  "12." -> 12, "-3" -> -3, "12.5" -> 12.5. One difference, towards the intended "last number":
  a match with no digit at all (the harness's regex also matches "..." or ",,") is skipped rather
  than taken as the answer. It credits a small model that states the right number without the box,
  and it is honest about the rest: a response that only echoes the question ("What is 7 + 5?")
  extracts 5 and is wrong; a response with no number is wrong.

`is_correct(response, answer, mode)`: math-verify equivalence of the extracted answer and the
gold one ("12" and "12.0" are equal), with a whitespace/`$`-insensitive string comparison as a
fallback for what math-verify cannot parse.

`pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k),
computed as a stable product; `avg_at_k`: the mean accuracy over one prompt's samples.
"""

from __future__ import annotations

import math
import re
from typing import Literal

Mode = Literal["strict", "flexible"]
MODES: tuple[Mode, ...] = ("strict", "flexible")

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# lm-evaluation-harness, lm_eval/tasks/gsm8k/gsm8k.yaml, filter `flexible-extract` (group_select -1).
_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def extract_boxed(text: str) -> str | None:
    """The last boxed answer with balanced braces; None if there is none (or it never closes)."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_last_number(text: str) -> str | None:
    """The response's final number, cleaned (`$` and thousands separators dropped, trailing periods
    removed); None when the response holds no digit."""
    for m in reversed(list(_NUMBER.finditer(text))):
        s = m.group(0).replace("$", "").replace(",", "").rstrip(".")
        if any(ch.isdigit() for ch in s):
            return s
    return None


def extract(response: str, mode: Mode = "strict") -> str | None:
    """The answer `mode` extracts from `response` (None: nothing to grade)."""
    if mode == "strict":
        return extract_boxed(response)
    if mode == "flexible":
        return extract_last_number(response)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def is_correct(response: str, answer: str, mode: Mode = "strict") -> bool:
    """True when the answer `mode` extracts from the response equals `answer` mathematically."""
    pred = extract(response, mode)
    return bool(pred) and equivalent(pred, answer)


def grade(response: str, answer: str) -> dict[str, bool]:
    """Both gradings of one response: {"strict": bool, "flexible": bool}."""
    return {mode: is_correct(response, answer, mode) for mode in MODES}


def equivalent(pred: str, answer: str) -> bool:
    """math-verify equivalence of an extracted answer and the gold one (string fallback)."""
    from math_verify import parse, verify

    try:
        gold_parsed = parse(f"${answer}$")
        pred_parsed = parse(f"$\\boxed{{{pred}}}$")
        if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed):
            return True
    except Exception:  # noqa: BLE001 - math-verify raises on exotic input: count as wrong
        pass
    return _normalise(pred) == _normalise(answer)


def _normalise(s: str) -> str:
    return re.sub(r"\s+|\\[,!;: ]|\$", "", s).rstrip(".")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is
    correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(correct: list[bool]) -> float:
    """Mean accuracy over the samples of one prompt."""
    return sum(correct) / len(correct) if correct else 0.0
