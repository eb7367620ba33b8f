"""A deterministic family of short-answer arithmetic problems for the CPU presets.

The teacher of the CPU preset is SmolLM2-135M-Instruct: it solves one-digit addition,
subtraction and multiplication, two-digit addition and one-step word problems well enough (with
the preset's few-shot prompt, see docs/run.md) and little beyond, so the family is exactly that.
Every record is {"id", "prompt", "answer", "kind", "expr"}: `expr` is the arithmetic the prompt
asks for ("7 + 5"), so a test can check `answer` independently of the generator.

    python -m eopd_trainer.problems.generator --out data/arith --train 512 --heldout 64 --seed 0

writes `train.jsonl` and `heldout.jsonl`. The splits are disjoint by *problem*, not only by
wording: a held-out problem's operation and operands (7 + 5, in any phrasing or story) never occur
in the training split, so held-out accuracy cannot come from remembering a training answer.
Generation depends only on the seed (Python's `random.Random`). Several phrasings per kind, so a
student trained on them is not tied to one wording.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Zoe", "Leo", "Mia"]
ITEMS = ["apples", "books", "pencils", "marbles", "cookies", "stickers", "coins", "cards"]

# Phrasings of a bare operation; {a} {op} {b} with op one of the symbols below.
ASK = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.", "How much is {a} {op} {b}?"]


@dataclass(frozen=True)
class Problem:
    kind: str
    a: int
    op: str  # "+", "-" or "*"
    b: int
    prompt: str

    @property
    def key(self) -> tuple[str, int, int]:
        """The problem's identity, whatever its wording: the split is disjoint on this."""
        return (self.op, self.a, self.b)

    @property
    def expr(self) -> str:
        return f"{self.a} {self.op} {self.b}"


def _ask(r: random.Random, kind: str, a: int, op: str, b: int) -> Problem:
    return Problem(kind, a, op, b, r.choice(ASK).format(a=a, op=op, b=b))


def _add1(r: random.Random) -> Problem:
    return _ask(r, "add1", r.randint(1, 9), "+", r.randint(1, 9))


def _sub1(r: random.Random) -> Problem:
    a = r.randint(2, 9)
    return _ask(r, "sub1", a, "-", r.randint(1, a))


def _mul1(r: random.Random) -> Problem:
    return _ask(r, "mul1", r.randint(2, 9), "*", r.randint(2, 9))


def _add2(r: random.Random) -> Problem:
    return _ask(r, "add2", r.randint(10, 49), "+", r.randint(10, 49))


def _more(r: random.Random) -> Problem:
    n, it, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    text = r.choice(["{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?",
                     "{n} has {a} {it}. A friend gives {n} {b} more. How many {it} does {n} have?"])
    return Problem("more", a, "+", b, text.format(n=n, a=a, it=it, b=b))


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "add1": _add1, "sub1": _sub1, "mul1": _mul1, "add2": _add2, "more": _more,
}

# The same family written differently (`generate_variants`): wordings the generator above never
# uses, operators in words, other stories, and other number ranges within the family. A check that
# what a student learns is the arithmetic, not the generator's phrasing.
_VARIANT_ASK = {
    "+": ["What do you get when you add {a} and {b}?", "What is the sum of {a} and {b}?", "Find {a} plus {b}."],
    "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.", "What do you get when you take {b} away from {a}?"],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?"],
}
_VARIANT_STORY = ["There are {a} birds on a tree and {b} more land on it. How many birds are on the tree now?",
                  "A shelf holds {a} cups. Someone puts {b} more cups on it. How many cups are on the shelf?",
                  "{n} walked {a} km in the morning and {b} km in the afternoon. How many km did {n} walk?"]


def _variant(r: random.Random, kind: str) -> Problem:
    if kind == "add1":
        a, b = r.randint(1, 9), r.randint(1, 9)
        return Problem(kind, a, "+", b, r.choice(_VARIANT_ASK["+"]).format(a=a, b=b))
    if kind == "sub1":  # answers up to 9, first operand up to 18 (the generator's stops at 9)
        b = r.randint(1, 9)
        a = b + r.randint(0, 9)
        return Problem(kind, a, "-", b, r.choice(_VARIANT_ASK["-"]).format(a=a, b=b))
    if kind == "mul1":  # one factor may be 10 (the generator's stop at 9)
        a, b = r.randint(2, 10), r.randint(2, 9)
        return Problem(kind, a, "*", b, r.choice(_VARIANT_ASK["*"]).format(a=a, b=b))
    if kind == "add2":  # two-digit sums up to 99 (the generator's operands stop at 49)
        a, b = r.randint(10, 69), r.randint(10, 29)
        return Problem(kind, a, "+", b, r.choice(_VARIANT_ASK["+"]).format(a=a, b=b))
    a, b = r.randint(2, 12), r.randint(2, 9)
    return Problem("more", a, "+", b, r.choice(_VARIANT_STORY).format(n=r.choice(NAMES), a=a, b=b))


def evaluate_expr(expr: str) -> int:
    """The value of "A OP B" (the `expr` of a record), computed without the generator."""
    a, op, b = expr.split()
    x, y = int(a), int(b)
    return {"+": x + y, "-": x - y, "*": x * y}[op]


def generate(n: int, seed: int, *, exclude: set[tuple[str, int, int]] | None = None,
             distinct_keys: bool = True) -> list[dict]:
    """`n` problems, none whose key is in `exclude`, cycling through the kinds. Prompts are always
    distinct; with `distinct_keys` so are the problems (else one problem may come in several
    wordings: the one-digit kinds have only 44 to 81 problems each)."""
    return _draw(n, seed, lambda r, kind: KINDS[kind](r), exclude=exclude, distinct_keys=distinct_keys)


def generate_variants(n: int, seed: int, *, exclude: set[tuple[str, int, int]] | None = None) -> list[dict]:
    """`n` distinct problems of the same kinds written as the generator never writes them (see
    `_VARIANT_ASK`), none whose key is in `exclude`."""
    return _draw(n, seed, _variant, exclude=exclude, distinct_keys=True, id_prefix="variant-")


def _draw(n: int, seed: int, make: Callable[[random.Random, str], Problem], *,
          exclude: set[tuple[str, int, int]] | None, distinct_keys: bool, id_prefix: str = "") -> list[dict]:
    r = random.Random(seed)
    excluded = set(exclude or ())
    seen: set = set()
    kinds = list(KINDS)
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot generate {n} distinct {id_prefix}problems with seed {seed}")
        kind = kinds[len(out) % len(kinds)]
        p = make(r, kind)
        ident = p.key if distinct_keys else p.prompt
        if p.key in excluded or ident in seen:
            continue
        seen.add(ident)
        out.append({"id": f"{id_prefix}{kind}-{seed}-{len(out)}", "prompt": p.prompt,
                    "answer": str(evaluate_expr(p.expr)), "kind": kind, "expr": p.expr})
    return out


def _key(record: dict) -> tuple[str, int, int]:
    a, op, b = record["expr"].split()
    return (op, int(a), int(b))


def make_splits(train: int, heldout: int, seed: int = 0, *, variants: int = 0) -> tuple[list[dict], ...]:
    """(train, held-out) or, with `variants`, (train, held-out, variants): the held-out problems
    first (their own seed), then the variants (none of them held-out), then the training split
    without any of either. Every split is disjoint from the others by problem."""
    held = generate(heldout, seed + 1_000_003)
    reserved = {_key(h) for h in held}
    var = generate_variants(variants, seed + 2_000_003, exclude=reserved) if variants else []
    reserved |= {_key(v) for v in var}
    tr = generate(train, seed, exclude=reserved, distinct_keys=False)
    return (tr, held, var) if variants else (tr, held)


def write_splits(out_dir: Path, train: int, heldout: int, seed: int = 0, *, variants: int = 0) -> tuple[Path, ...]:
    """train.jsonl and heldout.jsonl; with `variants`, also heldout_variants.jsonl: that many
    problems written differently (`generate_variants`), in neither other split."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ["train.jsonl", "heldout.jsonl"] + (["heldout_variants.jsonl"] if variants else [])
    paths = []
    for name, rows in zip(names, make_splits(train, heldout, seed, variants=variants), strict=True):
        (out_dir / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(out_dir / name)
    return tuple(paths)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="generate the arithmetic/word-problem dataset")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", type=int, default=0, help="also write this many problems written differently")
    args = p.parse_args(argv)
    for path in write_splits(args.out, args.train, args.heldout, args.seed, variants=args.variants):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
