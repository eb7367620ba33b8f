"""The teacher on a GPU, anyone can run it: random-initialised models of real shapes built on the GPU
(no download, `bench.random_models`), then, side by side in one run (`bench.bench_teacher`'s
interleaved rounds), a bare forward, the in-process engine and the server at 1 and 8 clients, with
the device-aware defaults (`auto`: bf16, whole batches, a client share of a whole batch on CUDA)
and with the CPU's fairness settings (512-token chunked prefill, 4096-token client shares).

    python -m bench.run_all gpu                 # or: python -m bench.bench_gpu_teacher
    python -m bench.bench_gpu_teacher --shapes qwen2-1.5b --batches 16x1024
    python -m bench.bench_gpu_teacher --smoke   # the same code on the CPU, tiny shapes, seconds (CI)

Writes the `gpu_teacher` section of docs/benchmarks.md and bench/results/gpu_teacher.json, naming
the card, the commit and the software versions. Without a CUDA device it prints why and exits 0
having measured nothing (`--smoke` runs on the CPU instead and writes nothing).

Definitions: bench/bench_teacher.py (scored tokens per second; "bare" = `model(ids).logits`, no
statistics; "engine" = `TransformersEngine.score` in process; "server" = `eopd-teacher serve`,
concurrent clients over TCP, its per-batch token budget one request's tokens). Targets (issue 30):
server >= 0.9x its engine at 1 and 8 clients; statistics <= +8% over the bare forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_teacher import breakdown_text
from bench.random_models import SHAPES, TINY, write_random_model
from bench.report import markdown_table, provenance, write_results, write_section

SECTION = "gpu_teacher"
# Server settings compared: the device-aware defaults, and the CPU's (issue 17's fairness settings).
PROFILES = {"auto": (), "cpu-fairness": ("--prefill-chunk-tokens", "512", "--max-batch-tokens-per-client", "4096")}


def parse_batch(text: str) -> dict:
    """'16x1024' -> 16 sequences of 1024 tokens, the second half scored (as the paper's responses)."""
    n, _, length = text.partition("x")
    seqs, length_i = int(n), int(length)
    return {"sequences": seqs, "length": length_i, "prompt": length_i // 2, "workload": "response half"}


def software() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
        out["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def run(shapes: list[str], batches: list[str], profiles: list[str], clients: int, rounds: int, smoke: bool,
        on_rows=None) -> list[dict]:
    """Every shape x profile: a random model built on the device (tiny and on the CPU in smoke mode).
    `on_rows(rows)` is called with the rows so far after each shape x profile (a run cut short by its
    time limit keeps what it measured)."""
    from bench.bench_teacher import bench_dtype, load_engine

    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    out = []
    with tempfile.TemporaryDirectory(prefix="eopd-gpu-bench-") as tmp:
        for name in shapes:
            shape = TINY if smoke else SHAPES[name]
            t0 = time.perf_counter()
            model_dir = write_random_model(Path(tmp) / name, shape, role="teacher", dtype=dtype, device=device)
            built_s = time.perf_counter() - t0
            print(f"[gpu_teacher] {name}: {shape.params() / 1e9:.2f}B parameters, built and saved in {built_s:.1f} s", flush=True)
            engine = load_engine("transformers", dtype, str(model_dir), device)  # once for every profile
            try:
                for profile in profiles:
                    rows = bench_dtype("transformers", dtype, [parse_batch(b) for b in batches], 16, rounds,
                                       sorted({1, clients}), model=str(model_dir), server_args=PROFILES[profile],
                                       device=device, engine=engine)
                    for r in rows:
                        r.update(shape=name, profile=profile, params_b=round(shape.params() / 1e9, 2))
                    out += rows
                    _free_cuda()
                    if on_rows is not None:
                        on_rows(out)
            finally:
                engine.shutdown()
                _free_cuda()
            for f in Path(model_dir).glob("*.safetensors"):  # the disk of a GPU machine is small
                f.unlink()
    return out


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    conc = rows[0]["concurrency"] if rows else []
    body = []
    for r in rows:
        body.append([r["shape"], f"{r['sequences']} x {r['length']} ({r['scored_per_batch']})", r["profile"],
                     f"{r['bare_tok_s']:.0f}", f"{r['engine_tok_s']:.0f}", f"{100 * r['stats_overhead_vs_bare']:+.1f}%"]
                    + [f"{r[f'server{c}_tok_s']:.0f} ({r[f'server{c}_vs_engine']:.3f}x)" for c in conc]
                    + [breakdown_text(r[f"server{c}_breakdown"]) for c in conc])
    headers = (["model shape", "batch (scored)", "server settings", "bare tok/s", "engine tok/s", "engine vs bare"]
               + [f"server, {c} client{'s' if c > 1 else ''}: tok/s (x engine)" for c in conc]
               + [f"server time, {c} client{'s' if c > 1 else ''}: engine / copy / split / encode / other" for c in conc])
    return markdown_table(headers, body)


def section_text(data: dict) -> str:
    sw, prov = data["software"], data["provenance"]
    rows = data["results"]
    lines = ["## Teacher on a GPU (`python -m bench.run_all gpu`)", "",
             f"On {sw.get('device', '?')} ({sw.get('device_memory_gib', '?')} GiB), torch {sw['torch']} (CUDA {sw['cuda']}), "
             f"transformers {sw['transformers']}, eopd@{prov.get('describe', '?')}, {data['minutes']:.1f} min; random "
             "bf16 models of the named shapes built on the GPU; rounds interleaved (bench/bench_teacher.py), medians.", "",
             table(rows), "",
             "Server time: shares of the clients' wall time (the server's /metrics histograms): its engine calls "
             "(which return once the batch is queued on the GPU: the pipelined path), waiting for the statistics' copy "
             "from the GPU, splitting per sequence, protobuf encoding, and the rest (RPC, decoding, validation, "
             "Python between batches).", ""]
    worst_server = min((r[f"server{c}_vs_engine"] for r in rows if r["profile"] == "auto" for c in r["concurrency"]), default=None)
    worst_stats = max((r["stats_overhead_vs_bare"] for r in rows if r["profile"] == "auto"), default=None)
    if worst_server is not None:
        lines.append(f"Targets (issue 30), default settings: server >= 0.9x its engine: worst {worst_server:.3f}x "
                     f"({'met' if worst_server >= 0.9 else '**not met**'}); statistics <= +8% over the bare forward: worst "
                     f"{100 * worst_stats:+.1f}% ({'met' if worst_stats <= 0.08 else '**not met**'}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2-1.5b", "llama3-8b"], choices=sorted(SHAPES))
    p.add_argument("--batches", nargs="+", default=["16x1024", "64x2048"], help="SEQUENCESxLENGTH (the second half scored)")
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    p.add_argument("--clients", type=int, default=8, help="the higher concurrency level (the lower is 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="on the CPU, a tiny model, one small batch, one round; writes nothing")
    args = p.parse_args(argv)
    import torch

    if args.smoke:
        args.shapes, args.batches, args.rounds, args.clients = ["tiny"], ["2x64"], 1, 2
    elif not torch.cuda.is_available():
        print("[gpu_teacher] skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "`--smoke` runs the same code on the CPU", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    planned = len(args.shapes) * len(args.profiles)

    def partial(rows: list[dict]) -> None:  # the last part is written once, below
        done = len(rows) // len(args.batches)
        if done < planned:
            finish(SECTION, rows, args, t0, table, section_text, done=done, planned=planned)

    rows = run(args.shapes, args.batches, args.profiles, args.clients, args.rounds, args.smoke, on_rows=partial)
    return finish(SECTION, rows, args, t0, table, section_text)


def finish(section: str, rows: list[dict], args, t0: float, table_fn, section_fn, *, done: int | None = None,
           planned: int | None = None) -> int:
    """Prints the table; a full (not smoke) run writes bench/results/<section>.json (rows, card,
    versions, commit) and the docs section rendered from it. `done` of `planned` parts measured so
    far: written after each part, so that a run its time limit cuts short keeps what it measured
    (marked incomplete until the last part)."""
    data = {"results": rows, "software": software(), "provenance": provenance(), "minutes": (time.perf_counter() - t0) / 60,
            "args": vars(args)}
    if done is not None and planned is not None and done < planned:
        data["incomplete"] = f"{done} of {planned} planned parts measured (the run stopped or is still going)"
    print(table_fn(rows), flush=True)
    if not args.smoke:
        path = write_results(section, data)
        text = section_fn(json.loads(path.read_text()))
        if "incomplete" in data:
            text += f"\n**Incomplete:** {data['incomplete']}.\n"
        write_section(section, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
