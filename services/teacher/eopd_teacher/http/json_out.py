"""A `/v1/completions` answer as JSON bytes, encoded in bounded pieces: exactly
`json.dumps(answer, separators=(",", ":"))`, but no single call of the C encoder (which holds the
GIL for its whole run) covers more than CHUNK elements of a long list, so encoding a 68 MB answer
in a worker thread never stalls the event loop for more than a few milliseconds at a time
(issue 33, section 1: one such answer made another client wait 15 s)."""

from __future__ import annotations

import json

CHUNK = 128  # list elements per encoder call (a prompt_logprobs position holds up to max_top_k + 1 entries)
MAX_DEPTH = 5  # containers below this depth are encoded whole (the answer's per-position entries are at 4-5)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _pieces(obj, depth: int, out: list[str]) -> None:
    if depth < MAX_DEPTH and isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append("," if i else "")
            out.append(_dumps(key) + ":")
            _pieces(value, depth + 1, out)
        out.append("}")
    elif isinstance(obj, list) and len(obj) > 1 and (depth < MAX_DEPTH or len(obj) > CHUNK):
        out.append("[")
        if depth < MAX_DEPTH:
            for i, value in enumerate(obj):
                out.append("," if i else "")
                _pieces(value, depth + 1, out)
        else:
            for i in range(0, len(obj), CHUNK):
                out.append("," if i else "")
                out.append(_dumps(obj[i:i + CHUNK])[1:-1])
        out.append("]")
    else:
        out.append(_dumps(obj))


def answer_bytes(answer) -> bytes:
    """`answer` (dicts, lists, strings, numbers, None) as compact JSON, UTF-8 (ASCII-escaped)."""
    out: list[str] = []
    _pieces(answer, 0, out)
    return "".join(out).encode()
