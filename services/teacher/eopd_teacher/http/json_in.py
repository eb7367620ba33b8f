"""A `/v1/completions` request body parsed from JSON without holding the GIL for long.

`json.loads` is one C call: an 8 MiB body of token ids holds the GIL for 0.2-0.3 s, so even in a
worker thread it stalls the event loop every other HTTP client shares (issue 33, section 1). ijson's
yajl2_c backend is fed the same body in pieces of BUF_SIZE bytes through its push interface
(`items_coro`), one C call each, so the loop gets the GIL between them (measured on the loaded 2-core
machine, an 8 MiB body of ids parsed in a thread: the loop's longest stall 20 ms instead of 0.44-0.49
s, total time about the same). `ijson.items` on a file object would not do: it reads and parses the
whole body inside one C call.

yajl has no nesting limit and ijson keeps a path string per open level (memory quadratic in the
depth: 30,000 `[` cost 2.1 GiB), so `nesting_depth` measures the depth first, vectorised, string
contents skipped, in pieces of SCAN_PIECE bytes (a few MiB of scratch whatever the body's size).

Small bodies (at most SMALL bytes: json.loads holds the GIL for under ~30 ms there) that yajl
refuses are given to `json.loads`, so a number beyond 64 bits (yajl's `integer overflow`) still
reaches field validation and its 400 names the field, as before; NaN and Infinity are refused on both
paths."""

from __future__ import annotations

import io
import json

import ijson
import numpy as np

MAX_DEPTH = 64  # a request nests 3 deep ({"prompt": [[ids]]}); anything deeper is refused unparsed
BUF_SIZE = 16 * 1024  # bytes yajl parses per C call (a few tenths of a millisecond each)
SCAN_PIECE = 1 << 20  # bytes the depth scan looks at per step
SMALL = 1 << 20  # bodies up to this size fall back to json.loads where yajl refuses them

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class TooDeep(ValueError):
    """The body nests deeper than MAX_DEPTH."""


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of `[`/`{` in `raw`, brackets inside JSON strings not counted (escaped
    quotes followed); stops counting once it passes `limit` and returns a value above it. Exact for
    valid JSON; for invalid JSON a number the parser never reaches past the first error."""
    depth, in_string, backslashes = 0, False, 0  # carried from one piece to the next
    deepest = 0
    for start in range(0, len(raw), SCAN_PIECE):
        b = np.frombuffer(raw, np.uint8, count=min(SCAN_PIECE, len(raw) - start), offset=start)
        quote = b == _QUOTE
        if quote.any():
            is_bs = b == _BACKSLASH
            if is_bs.any() or backslashes:
                # the length of the run of backslashes just before each byte (the run carried in)
                idx = np.arange(b.size, dtype=np.int64)
                last_plain = np.maximum.accumulate(np.where(is_bs, -1, idx))
                before = np.empty(b.size, np.int64)
                before[0] = backslashes
                before[1:] = idx[:-1] - last_plain[:-1]
                carried = last_plain[:-1] < 0  # still inside the run carried in from the last piece
                before[1:][carried] += backslashes
                quote &= before % 2 == 0
            inside = (np.cumsum(quote, dtype=np.int64) + in_string) % 2 == 1
            in_string = bool(inside[-1])
            steps = np.where(inside, 0, _OPEN[b])
        else:
            steps = np.zeros(b.size, np.int8) if in_string else _OPEN[b]
        plain = np.flatnonzero(b != _BACKSLASH)
        backslashes = b.size - 1 - int(plain[-1]) if plain.size else backslashes + b.size
        levels = depth + np.cumsum(steps, dtype=np.int64)
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
        if deepest > limit:
            break
    return deepest


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: bytes):
    """The JSON value in `raw`. Raises TooDeep (nested deeper than MAX_DEPTH) or ValueError (not
    JSON, not UTF-8, trailing data, NaN/Infinity) with the parser's message."""
    if nesting_depth(raw) > MAX_DEPTH:
        raise TooDeep(f"nested deeper than {MAX_DEPTH}")
    values = ijson.sendable_list()
    try:
        parser = ijson.items_coro(values, "", use_float=True)
        view = memoryview(raw)
        for start in range(0, len(raw), BUF_SIZE):  # one C call per piece: the GIL is free in between
            parser.send(bytes(view[start:start + BUF_SIZE]))
        parser.close()  # the end of the input: yajl refuses an empty or incomplete value here
    except ijson.JSONError as exc:
        if len(raw) <= SMALL:
            return json.loads(raw, parse_constant=_no_constants)
        raise ValueError(" ".join(str(exc).split())) from None
    return values[0]  # exactly one: yajl refuses a second value (trailing data) and an empty body
