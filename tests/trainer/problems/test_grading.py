"""The grading functions: strict (last \\boxed{}) and flexible (last number) extraction, math-verify
equivalence, the pass@k estimator."""

from __future__ import annotations

import itertools
import math

import pytest

from eopd_trainer.problems.grading import (
    avg_at_k,
    extract,
    extract_boxed,
    extract_last_number,
    grade,
    is_correct,
    pass_at_k,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("nested \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{ {a}+{b} }", "{a}+{b}"),
        ("no box here", None),
        ("unclosed \\boxed{12", None),
        ("\\fbox{7}", "7"),
        ("\\boxed {8}", "8"),
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_is_correct_uses_math_equivalence():
    assert is_correct("The answer is \\boxed{42}.", "42")
    assert is_correct("\\boxed{42.0}", "42")
    assert is_correct("\\boxed{\\frac{1}{2}}", "0.5")
    assert not is_correct("\\boxed{41}", "42")
    assert not is_correct("42", "42")  # no box, no credit
    assert not is_correct("\\boxed{}", "42")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 4 pears make 7", "7"),  # several numbers: the last wins
        ("7 + 5 = 12", "12"),  # the question's numbers echoed, then the answer
        ("What is 7 + 5? Let me think.", "5"),  # only the echo: its last number
        ("The result is -3.", "-3"),  # negative, trailing period
        ("18 - 27 = -9", "-9"),
        ("it costs $1,234 in total", "1234"),  # dollar sign, thousands separator
        ("1,234,567.", "1234567"),
        ("so 12.", "12"),
        ("so 12...", "12"),
        ("half is 12.5, right", "12.5"),
        ("12. ...", "12"),  # a digit-free match ("...") is skipped, not taken as the answer
        ("\\boxed{42}", "42"),
        ("no number at all", None),
        ("", None),
        ("-", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected
    assert extract(text, "flexible") == expected


def test_flexible_grading_edge_cases():
    assert is_correct("7 + 5 = 12", "12", mode="flexible")
    assert not is_correct("What is 7 + 5? Please reason step by step.", "12", mode="flexible")  # echo: 5
    assert is_correct("First 3, then 4, so the total is 12", "12", mode="flexible")
    assert not is_correct("The total is 12, not 13", "12", mode="flexible")  # last number wins, even when wrong
    assert is_correct("18 - 27 = -9", "-9", mode="flexible")
    assert not is_correct("18 - 27 = 9", "-9", mode="flexible")
    assert is_correct("That is 1,234 dollars.", "1234", mode="flexible")
    assert is_correct("$1,234", "1234", mode="flexible")
    assert is_correct("The answer is 12.0", "12", mode="flexible")  # equal values, different forms
    assert is_correct("The answer is 12", "12.0", mode="flexible")
    assert is_correct("it is 0.5", "\\frac{1}{2}", mode="flexible")
    assert not is_correct("I do not know.", "12", mode="flexible")  # no number: wrong, no crash
    assert not is_correct("", "12", mode="flexible")


def test_boxed_answers_keep_strict_grading():
    text = "7 + 5 = 12, so \\boxed{12}."
    assert grade(text, "12") == {"strict": True, "flexible": True}
    assert grade("7 + 5 = 12", "12") == {"strict": False, "flexible": True}  # no box: strict says wrong
    # strict reads the box, flexible the last number: they can disagree both ways
    assert grade("\\boxed{12} is wrong, it is 13", "12") == {"strict": True, "flexible": False}
    assert grade("\\boxed{13}, i.e. 12", "12") == {"strict": False, "flexible": True}
    assert grade("nothing", "12") == {"strict": False, "flexible": False}
    assert is_correct("\\boxed{12}", "12") == is_correct("\\boxed{12}", "12", mode="strict")


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        is_correct("12", "12", mode="loose")


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert math.isclose(pass_at_k(n, c, k), _brute_pass_at_k(n, c, k), abs_tol=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75 and avg_at_k([]) == 0.0
