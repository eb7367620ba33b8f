"""Where the test suite's time goes: the per-phase seconds that tests/conftest.py writes when
EOPD_TEST_DURATIONS=DIR is set, summed per test file (setup, call and teardown of every test in it),
slowest first, with each file's slowest test.

    EOPD_TEST_DURATIONS=/tmp/durations bash scripts/test.sh
    python -m scripts.test_durations /tmp/durations [--top 40] [--write tests/durations.json]

`--write` keeps the per-file seconds in the file tests/conftest.py orders the suite by (longest file
first: with two workers taking files in turn, the last files handed out are the short ones, and no
worker is left finishing a long file alone). Re-write it from a fresh-clone run when files are added
or their times change much; a file it does not name is ordered as conftest says.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def per_file(lines: list[str]) -> list[tuple[str, float, str, float]]:
    """(file, seconds, slowest test, its seconds) per file, slowest file first (pure)."""
    files: dict[str, float] = defaultdict(float)
    tests: dict[str, float] = defaultdict(float)
    for line in lines:
        seconds, _when, nodeid = line.split("\t", 2)
        files[nodeid.split("::")[0]] += float(seconds)
        tests[nodeid] += float(seconds)
    out = []
    for f, total in files.items():
        slowest = max((t for t in tests if t.split("::")[0] == f), key=tests.__getitem__)
        out.append((f, total, slowest.split("::", 1)[-1], tests[slowest]))
    return sorted(out, key=lambda r: -r[1])


def order_file(rows: list[tuple[str, float, str, float]], measured: str) -> dict:
    """What `--write` keeps: each file's seconds (one decimal), slowest first, and where they were measured."""
    return {"measured": measured, "seconds": {f: round(total, 1) for f, total, _, _ in rows}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--write", type=Path, default=None, help="keep the per-file seconds here (tests/durations.json)")
    p.add_argument("--measured", default="", help="with --write: the run they come from (commit, machine, date)")
    args = p.parse_args(argv)
    lines = [x for f in sorted(args.dir.glob("*.tsv")) for x in f.read_text().splitlines() if x]
    rows = per_file(lines)
    print(f"{len(lines)} phases, {sum(r[1] for r in rows):.0f} s in all, {len(rows)} files")
    for f, total, test, t in rows[: args.top]:
        print(f"{total:8.1f} s  {f}  (slowest: {test} {t:.1f} s)")
    if args.write:
        args.write.write_text(json.dumps(order_file(rows, args.measured), indent=1) + "\n")
        print(f"written: {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
