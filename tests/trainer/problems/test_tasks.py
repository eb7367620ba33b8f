"""The task generator: deterministic, splits disjoint by problem, every answer right."""

from __future__ import annotations

import ast
import json
import operator
import re

import pytest

from eopd_trainer.problems.generator import KINDS, generate, make_splits, write_splits

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def independent_value(expr: str) -> int:
    """The value of an arithmetic expression, through Python's parser (not the generator's code)."""
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected {ast.dump(node)}")
    return ev(ast.parse(expr, mode="eval").body)


def key(r: dict) -> tuple:
    a, op, b = r["expr"].split()
    return op, int(a), int(b)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_splits_are_deterministic_and_disjoint_by_problem(seed):
    tr, he = make_splits(512, 64, seed=seed)
    assert (tr, he) == make_splits(512, 64, seed=seed)
    assert len(tr) == 512 and len(he) == 64
    assert len({r["prompt"] for r in tr}) == 512 and len({r["id"] for r in tr + he}) == 576
    # disjoint by wording AND by problem: no held-out (op, a, b) is in the training split in any phrasing
    assert not {r["prompt"] for r in tr} & {r["prompt"] for r in he}
    assert not {key(r) for r in tr} & {key(r) for r in he}
    assert len({key(r) for r in he}) == 64  # held-out problems are distinct
    assert {r["kind"] for r in tr} == {r["kind"] for r in he} == set(KINDS)
    assert generate(5, seed) != generate(5, seed + 1)


def test_every_answer_is_the_value_of_the_problem_the_prompt_states():
    tr, he = make_splits(512, 64, seed=0)
    for r in tr + he:
        assert int(r["answer"]) == independent_value(r["expr"]), r
        a, op, b = r["expr"].split()
        numbers = re.findall(r"\d+", r["prompt"])
        assert numbers == [a, b], r  # the prompt states exactly these operands, in this order
        if r["kind"] in ("add1", "sub1", "mul1", "add2"):
            assert f"{a} {op} {b}" in r["prompt"], r
        else:
            assert op == "+" and "more" in r["prompt"], r
        assert int(r["answer"]) >= 0


def test_write_splits_writes_jsonl(tmp_path):
    a, b = write_splits(tmp_path, 10, 4)
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 10 and len(b.read_text().splitlines()) == 4
    assert set(rows[0]) == {"id", "prompt", "answer", "kind", "expr"}


def test_variants_are_written_differently_and_in_neither_split(tmp_path):
    from eopd_trainer.problems.generator import ASK

    tr, he, v = make_splits(512, 64, seed=0, variants=40)
    assert (tr, he, v) == make_splits(512, 64, seed=0, variants=40) and len(v) == 40
    assert not {key(r) for r in v} & {key(r) for r in tr + he}
    assert make_splits(512, 64, seed=0, variants=40)[1] == make_splits(512, 64, seed=0)[1]  # same held-out
    generator_forms = [re.compile(re.escape(t).replace(r"\{a\}", r"\d+").replace(r"\{op\}", ".").replace(r"\{b\}", r"\d+"))
                       for t in ASK]
    for r in v:
        assert int(r["answer"]) == independent_value(r["expr"]), r
        assert not any(f.fullmatch(r["prompt"]) for f in generator_forms), r  # none of the generator's wordings
        assert not re.search(r"\d [-+*] \d", r["prompt"]), r  # operators in words or stories
    paths = write_splits(tmp_path, 20, 10, variants=6)
    assert [p.name for p in paths] == ["train.jsonl", "heldout.jsonl", "heldout_variants.jsonl"]
    assert len(paths[2].read_text().splitlines()) == 6
