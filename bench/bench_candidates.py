"""Cost of per-position candidates (issue 19 section 4): the extra bytes on the wire and the extra
server time of `candidate_ids [n, m]` at m = 16, against the same requests without candidates.

    .venv/bin/python -m bench.bench_candidates [--quick] [--rounds 5] [--m 16]

A real `eopd-teacher serve` subprocess (transformers engine, fp32) scores the same batch with and
without candidates, in interleaved rounds (so load from elsewhere hits both alike); reported:
- wire bytes per scored token of the ScoreResponse (and of the ScoreRequest: the candidates travel
  both ways), from the serialized messages;
- the server's engine seconds per request (its /metrics batch-latency sum: decoder, projection,
  statistics and the candidates' gather) and the client's wall seconds, medians over the rounds.
Candidate ids are the student-like case: each position's ids drawn from the 20k most frequent ids.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.bench_teacher import _Server, _loadavg
from bench.report import markdown_table, write_results, write_section


def _batch(n_seqs: int, length: int, prompt: int, m: int, seed: int = 0):
    from eopd_teacher.client import SequenceInput

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_seqs):
        ids = rng.integers(100, 20000, length).tolist()
        cand = rng.integers(100, 20000, (length - prompt, m)) if m else None
        out.append(SequenceInput(f"s{i}", ids, prompt, cand))
    return out


def _wire(server: _Server, seqs, top_k: int) -> tuple[int, int]:
    from eopd_teacher.client import TeacherClient, build_request

    with TeacherClient(server.target, timeout=600) as c:
        req = build_request(seqs, top_k=top_k)
        resp = c._stub.Score(req)
        return len(resp.SerializeToString()), len(req.SerializeToString())


def _once(server: _Server, seqs, top_k: int) -> tuple[float, float]:
    from eopd_teacher.client import TeacherClient

    with TeacherClient(server.target, timeout=600) as c:
        c.info()
        e0 = server.engine_seconds()
        t = time.perf_counter()
        c.score(seqs, top_k=top_k)
        wall = time.perf_counter() - t
    return wall, server.engine_seconds() - e0


def run(args) -> dict:
    server = _Server("transformers", "float32", max_batch_tokens=args.seqs * args.length)
    try:
        batches = {m: _batch(args.seqs, args.length, args.prompt, m) for m in (0, args.m)}
        scored = args.seqs * (args.length - args.prompt)
        wire = {m: _wire(server, b, args.top_k) for m, b in batches.items()}
        for b in batches.values():  # warm-up
            _once(server, b, args.top_k)
        times: dict[int, list[tuple[float, float]]] = {m: [] for m in batches}
        for _ in range(args.rounds):
            for m, b in batches.items():
                times[m].append(_once(server, b, args.top_k))
    finally:
        server.stop()
    rows = {}
    for m in batches:
        resp, req = wire[m]
        rows[m] = {
            "response_bytes_per_token": resp / scored,
            "request_bytes_per_token": req / scored,
            "engine_s": statistics.median(e for _, e in times[m]),
            "wall_s": statistics.median(w for w, _ in times[m]),
        }
    base, cand = rows[0], rows[args.m]
    return {
        "model": args.model, "top_k": args.top_k, "m": args.m, "seqs": args.seqs, "length": args.length,
        "prompt": args.prompt, "scored_tokens": scored, "rounds": args.rounds, "rows": {str(k): v for k, v in rows.items()},
        "extra_response_bytes_per_token": cand["response_bytes_per_token"] - base["response_bytes_per_token"],
        "extra_request_bytes_per_token": cand["request_bytes_per_token"] - base["request_bytes_per_token"],
        "engine_ratio": cand["engine_s"] / base["engine_s"],
        "wall_ratio": cand["wall_s"] / base["wall_s"],
    }


def section_text(d: dict) -> str:
    rows = [[f"m = {m}", r["response_bytes_per_token"], r["request_bytes_per_token"], r["engine_s"], r["wall_s"]]
            for m, r in d["rows"].items()]
    table = markdown_table(["candidates", "response bytes / scored token", "request bytes / scored token",
                            "server engine s / request (median)", "client wall s / request (median)"], rows)
    return (
        "## Per-position candidates (issue 19)\n\n"
        f"`{d['model']}`, transformers engine, fp32, top_k {d['top_k']}; one request of {d['seqs']} sequences x "
        f"{d['length']} tokens ({d['scored_tokens']} scored positions), with and without `candidate_ids [n, {d['m']}]`, "
        f"{d['rounds']} interleaved rounds (`python -m bench.bench_candidates`, {d['machine']}, "
        f"load {d['load']}).\n\n{table}\n\n"
        f"Candidates at m = {d['m']} add {d['extra_response_bytes_per_token']:.1f} bytes per scored token to the answer "
        f"(4 bytes per packed float32 log-prob) and {d['extra_request_bytes_per_token']:.1f} to the request (varint ids); "
        f"server engine time x{d['engine_ratio']:.3f}, client wall time x{d['wall_ratio']:.3f}: no difference "
        "beyond the noise of the machine's load (the statistics pass is unchanged; the candidates are one "
        "`[chunk, m]` gather from each chunk's logits, O(n m) beside the O(n V d) projection)."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m"])
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only; do not write results or docs")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 x 64 tokens, one round; prints, writes nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.length, args.prompt, args.rounds, args.no_write = 2, 64, 16, 1, True
    load = _loadavg()
    data = run(args)
    data["load"] = f"{load} -> {_loadavg()}"
    if args.no_write:
        print(data)
        return 0
    path = write_results("candidates", data)
    import json

    data = json.loads(path.read_text())
    write_section("candidates", section_text(data))
    print(section_text(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
