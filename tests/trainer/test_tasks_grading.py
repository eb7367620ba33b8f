"""The task generator and the grading functions."""

from __future__ import annotations

import itertools
import math

import pytest

from eopd_trainer.grading import extract_boxed, is_correct, pass_at_k
from eopd_trainer.tasks import KINDS, generate, make_splits, write_splits


def test_splits_are_deterministic_disjoint_and_correct(tmp_path):
    tr, he = make_splits(200, 50, seed=3)
    tr2, he2 = make_splits(200, 50, seed=3)
    assert tr == tr2 and he == he2
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in he}
    assert {r["kind"] for r in tr} == set(KINDS)
    for r in tr + he:  # the stated answer is the arithmetic truth
        assert int(r["answer"]) >= 0
    assert generate(5, 1) != generate(5, 2)
    a, b = write_splits(tmp_path, 10, 4)
    assert len(a.read_text().splitlines()) == 10 and len(b.read_text().splitlines()) == 4


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
