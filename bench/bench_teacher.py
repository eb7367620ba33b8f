"""Teacher throughput, side by side in one run: the server end to end (concurrent clients over
TCP) vs the in-process engine vs a bare forward pass without statistics, on SmolLM2-135M-Instruct,
fp32 and bf16 weights, two batch shapes and two concurrency levels; and wire bytes per scored token.

    .venv/bin/python -m bench.bench_teacher [--quick] [--dtypes float32 bfloat16] [--rounds 3]

Definitions (all in scored tokens per second):
- bare forward: `model(input_ids).logits` over the same batch (the lm_head at every position, no
  log-softmax, entropy or top-k): the cost of a forward pass a user would run anyway.
- in-process engine: `TransformersEngine.score` (decoder, projection at scored positions only,
  exact fp32 statistics, top-k), the number the server can reach at best.
- server: `eopd-teacher serve` in a subprocess, `c` client threads each sending one Score request
  of the same batch; protobuf encode/decode and the dynamic batcher included. The server's token
  budget per forward batch is one request's tokens, so it runs the same batch shape as the
  in-process engine and the ratio isolates the server's own cost.
The three are measured in interleaved rounds (bare, engine, server at each concurrency) with the
same model loaded in both processes, so load from elsewhere hits them alike; the reported ratios
are medians of the per-round ratios.
Targets (issue 2): server >= 0.9x in-process; statistics <= 15% over the bare forward;
<= 140 bytes per scored token at k = 16.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

from bench.report import markdown_table, write_results, write_section


def _batch(n_seqs: int, length: int, prompt: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = np.random.default_rng(seed)
    # Token ids from a realistic range of SmolLM2's vocabulary (frequent tokens are < 20k).
    return [(f"s{i}", rng.integers(100, 20000, length).tolist(), prompt) for i in range(n_seqs)]


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loadavg() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


class _Server:
    """`eopd-teacher serve` in a subprocess and a way to drive it with `c` concurrent clients."""

    def __init__(self, engine: str, dtype: str, max_batch_tokens: int, model: str = "smollm2-135m",
                 extra: tuple[str, ...] = ()):
        from eopd_trainer.job.supervisor import Supervisor
        from eopd_trainer.job.teacher_proc import start_teacher

        self.sup = Supervisor(Path(tempfile.mkdtemp(prefix="eopd-bench-teacher-")))
        self.proc = start_teacher(self.sup, model, "--engine", engine, "--dtype", dtype, "--max-batch-tokens",
                                  str(max_batch_tokens), *extra, insecure_no_auth=True)  # port 0 for both servers, read from its ports file
        self.gp, self.hp = self.proc.ports(600)
        self.target = self.proc.target
        self.proc.wait_ready(600)

    def counters(self) -> dict[str, float]:
        """The server's /metrics sums so far: `engine_s`, the seconds its engine has spent scoring
        (the same `engine.score(items)` call the bench times in process, timed inside the server),
        and its time breakdown (`copy_wait_s`, `split_s`, `encode_s`, `queue_wait_s`)."""
        from bench.bench_pipeline import teacher_counters

        return teacher_counters(self.hp)

    def engine_seconds(self) -> float:
        return self.counters()["engine_s"]

    def wire_bytes(self, seqs, top_k: int) -> tuple[int, int]:
        from eopd_teacher.client import TeacherClient, build_request

        with TeacherClient(self.target, timeout=600) as c:
            req = build_request(seqs, top_k=top_k)
            resp = c._stub.Score(req)
            return len(resp.SerializeToString()), len(req.SerializeToString())

    def run(self, seqs, top_k: int, clients: int) -> tuple[float, float, float, dict[str, float]]:
        """(wall seconds, server CPU seconds, the server's engine seconds, its time breakdown:
        BREAKDOWN's seconds) for `clients` concurrent Score calls of `seqs`."""
        from eopd_teacher.client import TeacherClient

        errors: list[BaseException] = []
        conns = [TeacherClient(self.target, timeout=600) for _ in range(clients)]
        for c in conns:
            c.info()  # connected before the clock starts
        barrier = threading.Barrier(clients + 1)

        def one(c):
            try:
                barrier.wait()
                c.score(seqs, top_k=top_k)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(c,)) for c in conns]
        for th in threads:
            th.start()
        before = self.counters()
        cpu0 = _proc_cpu_seconds(self.proc.popen.pid)
        t = time.perf_counter()
        barrier.wait()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t
        cpu = _proc_cpu_seconds(self.proc.popen.pid) - cpu0
        after = self.counters()
        engine_s = after["engine_s"] - before["engine_s"]
        breakdown = {k: after[k] - before[k] for k in BREAKDOWN}
        for c in conns:
            c.close()
        if errors:
            raise errors[0]
        return elapsed, cpu, engine_s, breakdown

    def stop(self) -> None:
        self.sup.stop_all()


# The server's time besides its engine (issue 30): its histograms' sums per run (bench_pipeline.teacher_counters).
BREAKDOWN = ("copy_wait_s", "split_s", "encode_s", "queue_wait_s")


def breakdown_shares(per_round: list[dict], c: int) -> dict[str, float]:
    """Medians over rounds of the server's time, as shares of the clients' wall time for the run:
    `engine` (its engine calls), `copy` (waiting for the statistics' copy from the device after the
    engine call returned: 0 on the CPU), `split` (per sequence), `encode` (protobuf, per request),
    `other` (the rest: RPC, decoding, validation, Python between batches, the engine thread idle);
    and `queue_wait`, a batch's oldest sequence's wait in the queue per batch over the wall (not
    additive: it overlaps the engine time of the batches before it)."""
    def share(key):
        return statistics.median([x[f"server{c}_breakdown"][key] / x[f"server{c}_s"] for x in per_round])

    out = {"engine": statistics.median([x[f"server{c}_engine_s"] / x[f"server{c}_s"] for x in per_round]),
           "copy": share("copy_wait_s"), "split": share("split_s"), "encode": share("encode_s"), "queue_wait": share("queue_wait_s")}
    out["other"] = max(0.0, 1 - out["engine"] - out["copy"] - out["split"] - out["encode"])
    return out


def breakdown_text(b: dict[str, float]) -> str:
    return " / ".join(f"{100 * b[k]:.1f}%" for k in ("engine", "copy", "split", "encode", "other"))


def load_engine(engine_name: str, dtype: str, model: str, device: str = "auto"):
    """The in-process engine `bench_dtype` measures (loaded; the caller shuts it down)."""
    from eopd_teacher.engines import create_engine
    from eopd_teacher.settings import TeacherSettings

    eng = create_engine(TeacherSettings(model=model, dtype=dtype, engine=engine_name, device=device))
    eng.load()
    return eng


def bench_dtype(engine_name: str, dtype: str, configs: list[dict], top_k: int, rounds: int, concurrency: list[int],
                model: str = "smollm2-135m", server_args: tuple[str, ...] = (), device: str = "auto",
                engine=None) -> list[dict]:
    """Every configuration of one engine and dtype: the engine in this process, the server (started
    with `server_args` more) in a subprocess; `model` any model spec, `device` the engine's. `engine`:
    one already loaded by `load_engine` (kept open: several server settings measured beside one
    engine load the model once), else loaded here and shut down at the end."""
    from eopd_teacher.types import ScoreItem

    eng = engine if engine is not None else load_engine(engine_name, dtype, model, device)
    tokens_per_batch = max(c["sequences"] * c["length"] for c in configs)
    server = _Server(engine_name, dtype, tokens_per_batch, model, ("--device", device, *server_args))
    on_cuda = str(getattr(eng, "_device", "cpu")).startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    out = []
    try:
        for cfg in configs:
            seqs = _batch(cfg["sequences"], cfg["length"], cfg["prompt"])
            items = [ScoreItem(s, np.asarray(ids, dtype=np.int64), f, top_k, 1.0) for s, ids, f in seqs]
            scored = sum(len(ids) - f for _, ids, f in seqs)
            ids = torch.tensor([x[1] for x in seqs], device=eng._device if on_cuda else "cpu")

            if engine_name == "transformers":

                def bare():
                    with torch.inference_mode():
                        eng._lm.model(input_ids=ids).logits
                        sync()  # the GPU's work, not only its launch
            else:  # vLLM's forward (hidden states) and the output projection at every position, no statistics

                def bare():
                    with torch.inference_mode():
                        [torch.nn.functional.linear(h.to(eng._weight.dtype), eng._weight, eng._bias) for h in eng.hidden_states(items)]
                        sync()

            def engine():
                eng.score(items)

            bare(), engine(), server.run(seqs, top_k, 1)  # warm-up (allocator, compiled kernels' shapes)
            per_round = []
            for _ in range(rounds):
                rec = {}
                rec["bare_s"], rec["bare_cpu_s"] = _timed(bare)
                rec["engine_s"], rec["engine_cpu_s"] = _timed(engine)
                for c in concurrency:
                    (rec[f"server{c}_s"], rec[f"server{c}_cpu_s"], rec[f"server{c}_engine_s"],
                     rec[f"server{c}_breakdown"]) = server.run(seqs, top_k, c)
                per_round.append(rec)
            r = {"engine": engine_name, "dtype": dtype, **cfg, "top_k": top_k, "scored_per_batch": scored, "rounds": per_round,
                 "concurrency": concurrency}
            med = lambda xs: statistics.median(xs)  # noqa: E731
            r["bare_tok_s"] = med([scored / x["bare_s"] for x in per_round])
            r["engine_tok_s"] = med([scored / x["engine_s"] for x in per_round])
            r["bare_cpu_s_per_1k"] = med([1000 * x["bare_cpu_s"] / scored for x in per_round])
            r["engine_cpu_s_per_1k"] = med([1000 * x["engine_cpu_s"] / scored for x in per_round])
            r["stats_overhead_vs_bare"] = med([x["engine_s"] / x["bare_s"] - 1 for x in per_round])
            r["stats_overhead_vs_bare_cpu"] = med([x["engine_cpu_s"] / x["bare_cpu_s"] - 1 for x in per_round])
            for c in concurrency:
                r[f"server{c}_tok_s"] = med([c * scored / x[f"server{c}_s"] for x in per_round])
                r[f"server{c}_cpu_s_per_1k"] = med([1000 * x[f"server{c}_cpu_s"] / (c * scored) for x in per_round])
                # Per round: c requests on the server vs the engine's time for one batch, per token.
                r[f"server{c}_vs_engine"] = med([x["engine_s"] * c / x[f"server{c}_s"] for x in per_round])
                r[f"server{c}_vs_engine_cpu"] = med([x["engine_cpu_s"] * c / x[f"server{c}_cpu_s"] for x in per_round])
                # The same engine call timed inside the server process: the serving overhead alone
                # (RPC, validation, batching, (de)serialization), free of process-to-process speed.
                r[f"server{c}_vs_own_engine"] = med([x[f"server{c}_engine_s"] / x[f"server{c}_s"] for x in per_round])
                r[f"server{c}_engine_vs_engine"] = med([x["engine_s"] * c / x[f"server{c}_engine_s"] for x in per_round])
                r[f"server{c}_breakdown"] = breakdown_shares(per_round, c)
            top = max(concurrency)
            r["server_tok_s"], r["server_vs_engine"] = r[f"server{top}_tok_s"], r[f"server{top}_vs_engine"]
            r["server_vs_engine_cpu"] = r[f"server{top}_vs_engine_cpu"]
            r["server_vs_own_engine"] = min(r[f"server{c}_vs_own_engine"] for c in concurrency)
            r["server_engine_vs_engine"] = r[f"server{top}_engine_vs_engine"]
            r["server_cpu_s_per_1k"] = r[f"server{top}_cpu_s_per_1k"]
            resp_b, req_b = server.wire_bytes(seqs, top_k)
            r["response_bytes_per_token"], r["request_bytes_per_token"] = resp_b / scored, req_b / scored
            out.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "rounds"}), flush=True)
    finally:
        server.stop()
        if engine is None:
            eng.shutdown()
    return out


def render(results: list[dict], args, load_start: str, minutes: float) -> None:
    """Prints the table; a full run also writes bench/results/<section>.json, then the docs section
    from that JSON (the same code path as `--render`)."""
    print(_table(results))
    if args.quick:  # a smoke run: small shapes, one round; it writes neither results nor docs
        return
    section = "teacher" if args.engine == "transformers" else f"teacher_{args.engine}"
    extra = {}
    if args.engine == "vllm":
        import vllm

        extra["vllm_version"] = vllm.__version__
    path = write_results(section, {"results": results, "rounds": args.rounds, "engine": args.engine, "load_start": load_start,
                                   "load_end": _loadavg(), "minutes": minutes, **extra})
    write_section(section, section_text(json.loads(path.read_text())))


def _table(results: list[dict]) -> str:
    conc = results[0]["concurrency"] if results else []
    rows = []
    for r in results:
        row = [r.get("engine", "transformers"), r["dtype"], f"{r['sequences']} x {r['length']}", r["workload"],
               f"{r['bare_tok_s']:.0f}", f"{r['engine_tok_s']:.0f}"]
        row += [f"{r[f'server{c}_tok_s']:.0f}" for c in conc]
        row += [f"{r[f'server{c}_vs_engine']:.2f}x ({r[f'server{c}_vs_engine_cpu']:.2f}x)" for c in conc]
        if "server_vs_own_engine" in r:
            row += [" / ".join(f"{r[f'server{c}_vs_own_engine']:.2f}" for c in conc), f"{r['server_engine_vs_engine']:.2f}x"]
        row += [f"{100 * r['stats_overhead_vs_bare']:+.0f}% ({100 * r['stats_overhead_vs_bare_cpu']:+.0f}%)",
                f"{r['bare_cpu_s_per_1k']:.2f} / {r['engine_cpu_s_per_1k']:.2f} / {r['server_cpu_s_per_1k']:.2f}",
                f"{r['response_bytes_per_token']:.1f}"]
        rows.append(row)
    own = bool(results) and "server_vs_own_engine" in results[0]
    headers = (["engine", "weights", "batch", "scored positions", "bare forward tok/s", "in-process engine tok/s"]
               + [f"server, {c} client{'s' if c > 1 else ''} tok/s" for c in conc]
               + [f"server / engine, {c} client{'s' if c > 1 else ''}: wall (CPU)" for c in conc]
               + ([f"server / its own engine, same process ({' / '.join(map(str, conc))} clients)",
                   f"server's engine / in-process engine ({max(conc, default=1)} clients)"] if own else [])
               + ["engine vs bare: wall (CPU)", f"CPU s / 1k tok: bare / engine / server ({max(conc, default=1)} clients)",
                  "response bytes / scored token"])
    return markdown_table(headers, rows)


def _pct_range(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{100 * lo:+.0f}%" if round(100 * lo) == round(100 * hi) else f"{100 * lo:+.0f}% to {100 * hi:+.0f}%"


def reading(data: dict, other: dict | None = None) -> str:
    """The section's reading, generated from its JSON (and, only when measured on the same machine
    and clean commit, a comparison with the other engine's JSON `other`)."""
    from bench.report import provenance_of, same_machine_and_commit

    rs = data["results"]
    met = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    ws = min(rs, key=lambda r: r["server_vs_engine"])
    own = all("server_vs_own_engine" in r for r in rs)
    wt = max(rs, key=lambda r: r["stats_overhead_vs_bare"])
    wb = max(r["response_bytes_per_token"] for r in rs)
    desc = lambda r: f"{r['dtype']}, {r['sequences']} x {r['length']}, {r['workload']}"  # noqa: E731
    top = max(rs[0]["concurrency"]) if rs else 1
    lines = ["**Reading** (generated from this section's JSON)."]
    if own:
        wo = min(rs, key=lambda r: r["server_vs_own_engine"])
        spread = [r["server_engine_vs_engine"] for r in rs]
        lines += [
            f"- Server >= 0.9x the in-process engine, both in the server's process (its engine's time for the requests, "
            f"from its /metrics, over the clients' wall time for them: what serving adds, RPC, validation, batching and "
            f"(de)serialization): worst {wo['server_vs_own_engine']:.2f} ({desc(wo)}): {met(wo['server_vs_own_engine'] >= 0.9)}.",
            f"- Across processes (the server vs the engine in the benchmark's process): worst {ws['server_vs_engine']:.2f}x "
            f"with {top} clients ({desc(ws)}). That ratio also holds how fast each process runs the same code: the server's "
            f"engine ran the same batches at {min(spread):.2f}x to {max(spread):.2f}x the rate of the benchmark process's "
            "engine (same code, settings and batch): a difference between the two processes, which the cross-process ratio "
            "includes and the same-process one does not.",
        ]
    else:
        lines.append(f"- Server >= 0.9x the in-process engine: worst {ws['server_vs_engine']:.2f}x with {top} clients "
                     f"({desc(ws)}): {met(ws['server_vs_engine'] >= 0.9)}.")
    lines += [
             f"- Statistics <= +15% over the bare forward: worst {100 * wt['stats_overhead_vs_bare']:+.0f}% ({desc(wt)}): "
             f"{met(wt['stats_overhead_vs_bare'] <= 0.15)}.",
             f"- Response bytes per scored token <= 140 at k = 16: worst {wb:.1f}: {met(wb <= 140)}."]
    all_pos = [r["stats_overhead_vs_bare"] for r in rs if r["workload"] == "all positions"]
    resp = [r["stats_overhead_vs_bare"] for r in rs if r["workload"] != "all positions"]
    vllm = data.get("engine") == "vllm"
    if all_pos:
        bare = ("vLLM's forward and one output projection over every position" if vllm else
                "`model(ids).logits`, which materialises the [batch, seq, vocab] logits of the whole batch at once")
        lines.append(f"- Rows scoring every position: both sides project every position; the bare forward is {bare}, the "
                     f"engine projects in chunks of positions and computes the exact fp32 statistics and top-k on each "
                     f"chunk. Engine vs bare, wall: {_pct_range(all_pos)}. What this measures is the whole difference "
                     "between the two ways, not the cost of the statistics alone.")
    if resp:
        lines.append(f"- Rows scoring the response only: the engine projects only the scored positions, the bare forward "
                     f"every position. Engine vs bare, wall: {_pct_range(resp)}.")
    if other and other.get("results"):
        po, pd = provenance_of(other), provenance_of(data)
        if same_machine_and_commit(data, other):
            for r in rs:
                o = next((x for x in other["results"] if (x["dtype"], x["sequences"], x["length"], x["workload"]) ==
                          (r["dtype"], r["sequences"], r["length"], r["workload"])), None)
                if o:
                    lines.append(f"- Against the other engine's section (same machine and commit {pd['describe']}), "
                                 f"{desc(r)}: in-process engine {r['engine_tok_s'] / o['engine_tok_s']:.2f}x its rate.")
        else:
            lines.append(f"- Not compared with the {'transformers' if vllm else 'vLLM'} engine's section: the two were "
                         f"measured in different runs (eopd@{pd['describe']} at {pd['time']} vs eopd@{po['describe']} at "
                         f"{po['time']}); a comparison needs both from the same machine and commit.")
    return "\n".join(lines)


def section_text(data: dict) -> str:
    """The whole docs section, from a results JSON (a run's, or an older one via --render)."""
    from bench.report import RESULTS, header_line

    results = data["results"]
    conc = results[0]["concurrency"] if results else [1]
    section = "teacher" if data.get("engine", "transformers") == "transformers" else f"teacher_{data['engine']}"
    if section == "teacher":
        title, cmd = "Teacher: server vs in-process engine vs bare forward (issues 2, 9)", "`.venv/bin/python -m bench.bench_teacher`"
        bare_def = ("`model(ids).logits` over the same batch without statistics (the lm_head at every position, the "
                    "[batch, seq, vocab] logits materialised at once)")
        other_name = "teacher_vllm"
    else:
        title = "Teacher, vLLM engine: server vs in-process engine vs bare forward (issue 9)"
        version = data.get("vllm_version", "version not recorded by this run")
        cmd = f"`.venv-vllm/bin/python -m bench.bench_teacher --engine vllm` (vLLM {version}, eager, engine core in process)"
        bare_def = "vLLM's forward (`encode`, all-token hidden states) and the output projection at every position, without statistics"
        other_name = "teacher"
    other_path = RESULTS / f"{other_name}.json"
    other = json.loads(other_path.read_text()) if other_path.exists() else None
    return f"""## {title}

{header_line(cmd, data)}
SmolLM2-135M-Instruct, top-16, temperature 1, {data['rounds']} interleaved rounds per configuration (bare forward,
in-process engine, then the server at each concurrency), medians of the per-round rates and ratios (every
round is in `bench/results/{section}.json`). Throughput in scored tokens/s. "Bare forward" is
{bare_def}; the engine computes exact fp32 entropy, log-probs and top-k, projecting in chunks of
positions (only the scored ones); the server is `eopd-teacher serve` in a subprocess with a forward-batch
budget of one request's tokens (the same batch shape as the engine), driven by 1 or {max(conc)} concurrent
clients each sending one request of the batch per round. CPU columns: process CPU seconds (the server
process vs the bench process running the engine or the bare forward), less sensitive to other load than
wall time. Load average at the start: {data.get('load_start', 'not recorded')}; at the end:
{data.get('load_end', 'not recorded by this run')}; {data.get('minutes', 0.0):.1f} min in all.

{_table(results)}

{reading(data, other)}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small batches, one round, bf16 only unless --dtypes; prints, writes nothing")
    p.add_argument("--dtypes", nargs="+", default=None)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: run from .venv-vllm; writes its own section (teacher_vllm)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--clients", type=int, default=4, help="the higher concurrency level (the lower is 1)")
    p.add_argument("--render", "--from-json", dest="render", action="store_true",
                   help="rewrite the docs section from bench/results/teacher[_ENGINE].json without measuring")
    args = p.parse_args(argv)
    if args.render:
        from bench.report import RESULTS

        section = "teacher" if args.engine == "transformers" else f"teacher_{args.engine}"
        write_section(section, section_text(json.loads((RESULTS / f"{section}.json").read_text())))
        return 0
    args.dtypes = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float32"])
    args.rounds = args.rounds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    load_start = _loadavg()
    top_k = 16
    if args.quick:
        configs = [{"sequences": 4, "length": 128, "prompt": 1, "workload": "all positions"}]
    else:  # the same 4096 tokens per batch in every shape
        configs = [{"sequences": 8, "length": 512, "prompt": 1, "workload": "all positions"},
                   {"sequences": 8, "length": 512, "prompt": 128, "workload": "response only (prompt 25%)"},
                   {"sequences": 32, "length": 128, "prompt": 1, "workload": "all positions"}]
    concurrency = sorted({1, args.clients})
    results = []
    for dtype in args.dtypes:
        # The short-sequence shape in the first dtype only: fp32 rounds take 2.5x longer on this CPU.
        todo = configs if dtype == args.dtypes[0] else [c for c in configs if c["length"] >= 512] or configs
        results += bench_dtype(args.engine, dtype, todo, top_k, args.rounds, concurrency)
    render(results, args, load_start, (time.perf_counter() - t0) / 60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
