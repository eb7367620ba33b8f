"""Answer extraction, grading and the pass@k estimator (pure functions).

- `extract_boxed(text)`: the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), braces
  balanced, or None.
- `is_correct(response, answer)`: math-verify equivalence of the extracted answer and the gold one.
- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k),
  computed as a stable product.
"""

from __future__ import annotations

import math
import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


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


def is_correct(response: str, answer: str) -> bool:
    """True when the response's boxed answer equals `answer` mathematically (math-verify)."""
    pred = extract_boxed(response)
    if pred is None or not pred:
        return False
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
