"""A deterministic dataset of arithmetic and word problems with verifiable `\\boxed{}` answers,
for the CPU presets (the teacher is a 135M model: problems are one or two steps, small numbers).

    python -m eopd_trainer.tasks --out data/arith --train 512 --heldout 128 --seed 0

writes `train.jsonl` and `heldout.jsonl` with records {"id", "prompt", "answer", "kind"}. The two
splits never share a prompt. Generation depends only on the seed (Python's `random.Random`).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Zoe", "Leo", "Mia"]
ITEMS = ["apples", "books", "pencils", "marbles", "cookies", "stickers", "coins", "cards"]
CONTAINERS = ["boxes", "bags", "baskets", "shelves", "jars"]


def _add(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 60), r.randint(2, 60)
    return f"What is {a} + {b}?", a + b


def _sub(r: random.Random) -> tuple[str, int]:
    a = r.randint(10, 90)
    b = r.randint(1, a - 1)
    return f"What is {a} - {b}?", a - b


def _mul(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return f"What is {a} * {b}?", a * b


def _groups(r: random.Random) -> tuple[str, int]:
    n, c, k, it = r.choice(NAMES), r.choice(CONTAINERS), r.randint(2, 9), r.choice(ITEMS)
    m = r.randint(2, 9)
    return f"{n} has {k} {c} with {m} {it} in each. How many {it} does {n} have?", k * m


def _more(r: random.Random) -> tuple[str, int]:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(3, 40), r.randint(2, 30)
    return f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?", a + b


def _left(r: random.Random) -> tuple[str, int]:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    a = r.randint(10, 60)
    b = r.randint(1, a - 1)
    return f"{n} had {a} {it} and gave away {b}. How many {it} are left?", a - b


def _two_step(r: random.Random) -> tuple[str, int]:
    n, it = r.choice(NAMES), r.choice(ITEMS)
    k, m, b = r.randint(2, 6), r.randint(2, 9), r.randint(1, 10)
    return f"{n} buys {k} packs of {m} {it} and then finds {b} more. How many {it} does {n} have?", k * m + b


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "groups": _groups, "more": _more, "left": _left, "two_step": _two_step,
}


def generate(n: int, seed: int, *, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct problems (none in `exclude`), cycling through the kinds."""
    r = random.Random(seed)
    seen = set(exclude or ())
    kinds = list(KINDS)
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot generate {n} distinct problems with seed {seed}")
        kind = kinds[len(out) % len(kinds)]
        prompt, answer = KINDS[kind](r)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"id": f"{kind}-{seed}-{len(out)}", "prompt": prompt, "answer": str(answer), "kind": kind})
    return out


def make_splits(train: int, heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    held = generate(heldout, seed + 1_000_003)
    return generate(train, seed, exclude={h["prompt"] for h in held}), held


def write_splits(out_dir: Path, train: int, heldout: int, seed: int = 0) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    tr, he = make_splits(train, heldout, seed)
    paths = (out_dir / "train.jsonl", out_dir / "heldout.jsonl")
    for path, rows in zip(paths, (tr, he), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="generate the arithmetic/word-problem dataset")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--heldout", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path in write_splits(args.out, args.train, args.heldout, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
