"""Teacher generation throughput (issue 30, ask 5): the transformers engine's Generate, one prompt at
a time vs the prompts of a call decoded as one batch, side by side in one run, on the CPU.

    .venv/bin/python -m bench.bench_generate [--models tiny-random smollm2-135m] [--rounds 3] [--smoke]

Workload: `--prompts` prompts of 8 to 48 tokens (ids from SmolLM2's frequent range), `--samples`
samples each, `--max-new-tokens` new tokens, sampled at temperature 1.0 with a seed (so both paths
draw the same tokens; a row stops at EOS on its own), top_k 16 statistics, as Generate returns them.
- one at a time: `TransformersEngine.generate([item])` per prompt: the engine before batching
  decoded one prompt (its samples together) per call; this is that shape, on today's code.
- batched: `TransformersEngine.generate(items)`: every prompt and sample of the call in one batch
  (left-padded, rows leave the batch as they stop), statistics by one scoring pass over all rows.
Both run in the same process, in interleaved rounds (so load from elsewhere hits them alike); the
reported rates are medians over the rounds, and the speed-up is the median of the per-round ratios.
Generated tokens/s counts the tokens returned (statistics included); greedy parity (the two paths
give identical ids at temperature 0) is checked once per model and reported.

`--smoke` (CI): tiny-random, 3 prompts x 2 samples x 4 tokens, one round; prints, writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bench.bench_teacher import _loadavg
from bench.report import markdown_table, write_results, write_section


def _items(n_prompts: int, samples: int, max_new: int, temperature: float, seed: int = 0):
    from eopd_teacher.types import GenerateItem

    rng = np.random.default_rng(seed)
    return [GenerateItem(f"p{i}", rng.integers(100, 20000, int(rng.integers(8, 49))).astype(np.int64), samples, max_new,
                         temperature, 1.0, (), 1234, 16, 1.0, i) for i in range(n_prompts)]


def _engine(model: str):
    from eopd_teacher.engines.transformers_engine import TransformersEngine
    from eopd_teacher.settings import TeacherSettings

    # Whole steps: the benchmark measures decoding, not the batcher's turns (the steps only add
    # a return to the caller per turn).
    eng = TransformersEngine(TeacherSettings(model=model, device="cpu", compile_statistics=False,
                                             prefill_chunk_tokens=0, generate_step_ms=0).engine_settings())
    eng.load()
    return eng


def _one_at_a_time(eng, items):
    return [g for it in items for g in eng.generate([it])]


def _batched(eng, items):
    return eng.generate(items)


def measure(model: str, args) -> dict:
    eng = _engine(model)
    try:
        greedy = _items(args.prompts, 1, args.max_new_tokens, 0.0)
        parity = ([g.token_ids.tolist() for g in _one_at_a_time(eng, greedy)]
                  == [g.token_ids.tolist() for g in _batched(eng, greedy)])
        items = _items(args.prompts, args.samples, args.max_new_tokens, 1.0)
        paths = {"one at a time": _one_at_a_time, "batched": _batched}
        times: dict[str, list[float]] = {p: [] for p in paths}
        tokens: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                gens = fn(eng, items)
                times[name].append(time.perf_counter() - t)
                tokens[name] = sum(len(g.token_ids) for g in gens)
    finally:
        eng.shutdown()
    rows = {name: {"seconds": statistics.median(ts), "prompts_s": args.prompts / statistics.median(ts),
                   "tokens_s": tokens[name] / statistics.median(ts), "generated_tokens": tokens[name]}
            for name, ts in times.items()}
    speedups = [a / b for a, b in zip(times["one at a time"], times["batched"])]
    speedup = statistics.median(speedups)
    return {"model": model, "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds, "rows": rows, "speedup": speedup, "speedups": speedups, "greedy_identical": parity,
            "same_tokens": tokens["one at a time"] == tokens["batched"]}


def _speedup(r: dict) -> str:
    """The median per-round ratio, with the range of the rounds where recorded."""
    rounds = r.get("speedups") or []
    spread = f" (rounds x{min(rounds):.2f}..x{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"x{r['speedup']:.2f}{spread}"


def section_text(d: dict) -> str:
    table_rows = []
    for r in d["results"]:
        for name, row in r["rows"].items():
            table_rows.append([r["model"], f"{r['prompts']} x {r['samples']} x {r['max_new_tokens']}", name, row["seconds"],
                               row["prompts_s"], row["tokens_s"], _speedup(r) if name == "batched" else "",
                               "yes" if r["greedy_identical"] else "NO"])
    table = markdown_table(["model", "prompts x samples x max new", "path", "s / call (median)", "prompts / s",
                            "generated tokens / s", "batched vs one at a time", "greedy ids identical"], table_rows)
    return (
        "## Teacher generation batches (issue 30, ask 5)\n\n"
        f"`python -m bench.bench_generate`, {d['machine']}, load {d['load']}, {d['rounds']} interleaved rounds; "
        "the machine is shared with other jobs (the load average is given), so read the side-by-side ratio, not the "
        "absolute rates. The transformers engine in process, fp32, temperature 1.0 with a seed (both paths draw the same "
        "tokens), top_k 16 statistics; *one at a time* is one `generate` call per prompt (its samples decoded together: "
        "the engine's shape before batching), *batched* is one call for all prompts (left-padded, rows leave the batch "
        "as they stop). Both include the statistics pass (Score on prompt + response).\n\n"
        f"{table}\n\n"
        "Batching pays where one decode step is dominated by reading the weights (every row of a step shares one read): "
        "on a 2-core CPU that is the small-batch regime; on a GPU the gap is larger (not measured here: no GPU "
        "was available to this run)."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; do not write results or docs")
    p.add_argument("--smoke", "--quick", action="store_true",
                   help="CI: tiny-random, 3 prompts x 2 samples x 4 tokens, one round; prints, writes nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.prompts, args.samples, args.max_new_tokens, args.rounds, args.no_write = \
            ["tiny-random"], 3, 2, 4, 1, True
    from eopd_common.models import smollm2_gguf_path

    models = []
    for m in args.models:
        if m == "smollm2-135m":
            try:
                smollm2_gguf_path()
            except Exception as exc:  # noqa: BLE001 - the package is optional
                print(f"[generate] skipping smollm2-135m: {exc}")
                continue
        models.append(m)
    load = _loadavg()
    results = []
    for m in models:
        r = measure(m, args)
        print(json.dumps(r))
        results.append(r)
    data = {"results": results, "rounds": args.rounds, "load": f"{load} -> {_loadavg()}"}
    if args.no_write:
        return 0
    path = write_results("generate", data)
    data = json.loads(path.read_text())
    write_section("generate", section_text(data))
    print(section_text(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
