"""The task generator (the grading functions are tested in test_grading.py)."""

from __future__ import annotations

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
