"""Generated blocks of a markdown document: text between `<!-- generated: NAME -->` and
`<!-- /generated: NAME -->` belongs to the command named in the opening marker's line and is rewritten
by it, never by hand. `sync` writes the blocks, or with `check` only reports which ones differ from
what the command would write now (a test runs it that way, so a document cannot drift from its data).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path


def markers(name: str, command: str) -> tuple[str, str]:
    """The opening and closing marker lines of block `name`, the opening one naming `command`."""
    return f"<!-- generated: {name} by `{command}`; do not edit by hand -->", f"<!-- /generated: {name} -->"


def _pattern(name: str) -> re.Pattern:
    return re.compile(r"<!-- generated: " + re.escape(name) + r" .*?-->\n(.*?)<!-- /generated: "
                      + re.escape(name) + r" -->", re.S)


def read_block(text: str, name: str) -> str | None:
    """The body of block `name` in `text` (without its markers), or None when `text` has no such block."""
    m = _pattern(name).search(text)
    return m.group(1) if m else None


def replace_block(text: str, name: str, body: str, command: str) -> str:
    """`text` with block `name`'s body replaced by `body`; KeyError naming the block when it is missing
    (where a block goes is the document's choice: put the two marker lines there first)."""
    begin, end = markers(name, command)
    new, count = _pattern(name).subn(lambda _: f"{begin}\n{body.rstrip()}\n{end}", text)
    if count != 1:
        raise KeyError(f"generated block {name!r}: found {count} times (expected once; "
                       f"add the lines {begin!r} and {end!r} where it goes)")
    return new


def sync(path: Path, blocks: dict[str, str], command: str, *, check: bool) -> list[str]:
    """Writes each block of `blocks` (name -> body) into the document at `path`, or with `check` writes
    nothing. Returns the names of the blocks whose body differed from the given one."""
    text = path.read_text()
    stale = [name for name, body in blocks.items() if (read_block(text, name) or "").rstrip() != body.rstrip()]
    for name, body in blocks.items():
        text = replace_block(text, name, body, command)
    if not check and stale:
        path.write_text(text)
    return stale


def main(argv: list[str] | None, path: Path, build: Callable[[], dict[str, str]], command: str) -> int:
    """The command line of a document's generator: writes the blocks `build()` returns into `path`, or with
    `--check` writes nothing and exits 1 when one is out of date."""
    p = argparse.ArgumentParser(prog=command, description=f"Lay out {path.name}'s generated blocks from the archived runs.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block is out of date")
    args = p.parse_args(argv)
    stale = sync(path, build(), command, check=args.check)
    if stale and args.check:
        print(f"{path.name}: {', '.join(stale)} differ from the archived runs; run `{command}`", file=sys.stderr)
        return 1
    print(f"{path.name}: {', '.join(stale) + ' rewritten' if stale else 'up to date'}")
    return 0
