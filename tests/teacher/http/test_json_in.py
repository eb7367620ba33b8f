"""The request body parser (http/json_in.py): the same values as json.loads, the nesting depth
against a naive character-by-character scan, and the event loop's longest stall while a large body
is parsed in a worker thread."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from eopd_teacher.http import json_in


def naive_depth(text: str) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def random_value(rng: random.Random, depth: int):
    kind = rng.randrange(5 if depth < 6 else 3)
    if kind == 0:
        return rng.randrange(-10, 1 << 40)
    if kind == 1:  # strings full of brackets, quotes and backslash runs
        return "".join(rng.choice('[]{}"\\\\ab,:') for _ in range(rng.randrange(12)))
    if kind == 2:
        return rng.choice([None, True, False, 1.5])
    if kind == 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}[{{": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, json_in.SCAN_PIECE])
def test_nesting_depth_matches_a_naive_scan_across_piece_boundaries(monkeypatch, piece):
    monkeypatch.setattr(json_in, "SCAN_PIECE", piece)
    rng = random.Random(piece)
    for _ in range(300):
        text = json.dumps(random_value(rng, 0))
        assert json_in.nesting_depth(text.encode(), limit=1 << 30) == naive_depth(text), text


def test_nesting_depth_stops_past_the_limit():
    assert json_in.nesting_depth(b"[" * 10_000, limit=64) > 64
    assert json_in.nesting_depth(b'["' + b"[" * 10_000 + b'"]', limit=64) == 1  # inside a string


@pytest.mark.parametrize("raw", [
    b'{"prompt": [[1, 2, 3], [4]], "max_tokens": 0, "echo": true, "stop": null, "temperature": 0.5}',
    b'{"a": "\\u00e9\\"[{", "b": -1, "c": 1e-3, "a": 2}',  # duplicate key: the last wins, as json
    b'{"big": 18446744073709551616}',  # beyond 64 bits: small bodies fall back to json.loads
    b"  [1, 2]  ",
])
def test_loads_gives_what_json_loads_gives(raw):
    assert json_in.loads(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [b"", b"   ", b"[", b'{"a": 1} x', b'{"a": 1}{"b": 2}', b'{"a": NaN}',
                                 b'{"a": Infinity}', b'{"a": "\xff"}', b"{'a': 1}"])
def test_loads_refuses_what_is_not_one_json_value(raw):
    with pytest.raises(ValueError):
        json_in.loads(raw)


def test_loads_refuses_deep_nesting_before_parsing():
    for raw in (b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}"):
        with pytest.raises(json_in.TooDeep):
            json_in.loads(raw)
    assert json_in.loads(b"[" * 64 + b"]" * 64) == json.loads(b"[" * 64 + b"]" * 64)


def test_large_bodies_that_yajl_refuses_are_refused_with_its_message():
    raw = json.dumps({"prompt": [1] * (json_in.SMALL // 2)}).encode()[:-1] + b', "x": 1e999}'
    with pytest.raises(ValueError, match="overflow"):
        json_in.loads(raw)


@pytest.mark.serial  # a time bound: beside the other worker's processes the watching thread can be descheduled
def test_a_large_body_never_holds_the_gil_for_long():
    rng = random.Random(0)
    ids = [rng.randrange(49152) for _ in range(1_000_000)]
    raw = json.dumps({"prompt": [ids[i:i + 2048] for i in range(0, len(ids), 2048)], "max_tokens": 0}).encode()
    out: dict = {}
    gaps = held_stretches(lambda: out.setdefault("value", json_in.loads(raw)))
    assert out["value"] == json.loads(raw)
    # json.loads holds the GIL for the whole parse (0.15 s and more of CPU for this body); yajl gives it
    # back every BUF_SIZE bytes.
    assert len(gaps) > 1 and max(gaps) < 0.05, (len(gaps), max(gaps, default=None))


def held_stretches(parse) -> list[float]:
    """Runs `parse` in a thread while this one wakes every millisecond: the parsing thread's CPU
    seconds between two wake-ups that got the GIL. CPU time, not wall time: on a shared machine the
    process can be descheduled for tens of milliseconds, which says nothing about the GIL (wall-time
    gaps of 69 ms were seen beside other tests, with the GIL released on time)."""
    total: list[float] = []
    go = threading.Event()
    worker = threading.Thread(target=lambda: (go.wait(), parse(), total.append(time.thread_time())))
    worker.start()
    clock = time.pthread_getcpuclockid(worker.ident)
    gaps, last = [], time.clock_gettime(clock)
    go.set()  # the parse starts once this thread is watching
    while worker.is_alive():
        time.sleep(0.001)
        try:
            now = time.clock_gettime(clock)
        except OSError:  # the thread ended between the check and the read: its last stretch is below
            break
        gaps.append(now - last)
        last = now
    worker.join()
    gaps.append(total[0] - last)  # from the last wake-up to the end of the parse
    return gaps
