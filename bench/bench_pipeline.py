"""The whole pipeline end to end, side by side: scored tokens per second and the learner's idle
share in `sync` and `async` modes, with one and two teacher processes.

    .venv/bin/python -m bench.bench_pipeline [--quick] [--rounds R] [--iterations N] [--out FILE]

Real processes, as `eopd run` starts them (its helpers: `Supervisor`, `choose_queue`, `prepare`,
`start_teacher` from `eopd_trainer.job`): a Redis (REDIS_URL, else a redis-server on a free port),
one or two `eopd-teacher serve` processes, two `eopd-rollout` workers and one `eopd-train`
DeepSpeed learner, on the `smollm2-cpu` preset (teacher SmolLM2-135M-Instruct, student
`smollm2-135m[layers=0:30:3]`) or, with `--quick`, the `tiny` preset (tiny random models).

The teachers and Redis are started once and shared by every configuration (a configuration that
uses one teacher leaves the other idle); each configuration gets its own run directory, queue
namespace, workers and learner. With two teachers worker i is pointed at teacher i
(`teacher.target=` per worker): `ScoreStream` is one long-lived RPC per worker, so gRPC's
`round_robin` over a `dns:///` target balances *workers* (streams) over replicas, not requests,
and with two workers on one channel each it may put both on the same replica.

Measured over iterations 2..N (iteration 1 includes the workers' start-up):
- trained tok/s: response tokens the learner trained on (B x mean response length per
  iteration) per second of the learner's wall time between the end of iteration 1 and of N;
- learner idle: time blocked reading the rollouts stream (`iter/queue_wait_s`, logged by the
  learner) / wall time of those iterations;
- teacher busy: engine seconds (`eopd_teacher_batch_latency_seconds_sum`) / wall seconds, per
  teacher in use, from each teacher's /metrics at the start and end of the window; teacher tok/s
  from `eopd_teacher_tokens_scored_total` (includes tokens scored but not trained: rollouts
  published ahead in async mode, stale ones dropped);
- CPU seconds of every pipeline process (learner, workers, teachers; /proc) per 1k trained
  tokens, and the whole machine's busy share (/proc/stat), which shows other people's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import ROOT, machine_description, markdown_table, write_results, write_section

PRESETS = {
    # name: (config file, iterations, description)
    "smollm2-cpu": (ROOT / "configs" / "smollm2-cpu.yaml", 5,
                    "teacher SmolLM2-135M-Instruct (float32), student smollm2-135m[layers=0:30:3] (10 of 30 layers); "
                    "B = 16 rollouts of <= 48 response tokens, B_mini 8 (2 optimizer steps per iteration), top-16, "
                    "checkpoint every 4 iterations"),
    "tiny": (ROOT / "configs" / "tiny.yaml", 6,
             "teacher tiny-random@0, student tiny-random@1 (tiny random models, SmolLM2 tokenizer); B = 8 rollouts "
             "(4 prompts x 2 samples) of <= 16 response tokens, B_mini 4, top-64, checkpoint every iteration"),
}
WORKERS = 2


def _loadavg() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return float(total - idle), float(total)


_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


# The server's time besides the engine call (issue 30), from its histograms' sums.
_BREAKDOWN = {"eopd_teacher_copy_wait_seconds_sum": "copy_wait_s", "eopd_teacher_split_seconds_sum": "split_s",
              "eopd_teacher_encode_seconds_sum": "encode_s", "eopd_teacher_queue_wait_seconds_sum": "queue_wait_s"}


def teacher_counters(http_port: int) -> dict[str, float]:
    """The teacher's engine seconds, scored tokens and time breakdown so far (`_BREAKDOWN`), from
    its Prometheus /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics/", timeout=10) as r:
        text = r.read().decode()
    out = {"engine_s": 0.0, "tokens_scored": 0.0, "batches": 0.0, **{k: 0.0 for k in _BREAKDOWN.values()}}
    for line in text.splitlines():
        m = _PROM_LINE.match(line.strip())
        if not m:
            continue
        name, value = m.group(1), float(m.group(3))
        if name == "eopd_teacher_batch_latency_seconds_sum":
            out["engine_s"] += value
        elif name == "eopd_teacher_batch_latency_seconds_count":
            out["batches"] += value
        elif name == "eopd_teacher_tokens_scored_total":
            out["tokens_scored"] += value
        elif name in _BREAKDOWN:
            out[_BREAKDOWN[name]] += value
    return out


@dataclass
class Teacher:
    child: object  # eopd_trainer.job.supervisor.Child
    grpc_port: int
    http_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class Snapshot:
    t: float
    proc_cpu: dict[str, float]
    teachers: list[dict[str, float]]
    machine: tuple[float, float]
    records: int = 0
    extra: dict = field(default_factory=dict)


def _snapshot(procs: dict[str, int], teachers: list[Teacher], records: int) -> Snapshot:
    return Snapshot(time.monotonic(), {n: proc_cpu_seconds(pid) for n, pid in procs.items()},
                    [teacher_counters(t.http_port) for t in teachers], machine_cpu(), records)


def _iteration_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if rec.get("kind") == "iteration":
            out.append(rec)
    return out


def run_config(base_cfg, *, mode: str, n_teachers: int, teachers: list[Teacher], redis_url: str, work: Path,
               threads: int, iterations: int, timeout: float, tag: str, queue_env: dict[str, str] | None = None) -> dict:
    """One configuration: fresh workers and learner on the shared Redis and teachers; returns its
    measurements (see the module docstring)."""
    from eopd_trainer.config import dump_config, load_config
    from eopd_trainer.job.local_queue import run_key_file
    from eopd_trainer.job.supervisor import Supervisor

    run_dir = work / tag
    run_dir.mkdir(parents=True, exist_ok=True)
    queue = base_cfg.queue.model_copy(update={"redis_url": redis_url, "namespace": f"bench:{tag}:{time.time_ns()}"})
    queue = queue.model_copy(update={"auth_key_file": run_key_file(run_dir, queue)})  # signed, as `eopd run` does
    cfg = base_cfg.model_copy(update={
        "run_dir": run_dir,
        "mode": mode,
        "queue": queue,
        "teacher": base_cfg.teacher.model_copy(update={"target": teachers[0].target}),
        # Each worker takes half an iteration's tasks per round, so both have work in sync mode.
        # claim_idle_ms: reclaiming is for dead workers; with the default 30 s a live worker whose
        # batch takes longer on this loaded CPU has its tasks taken over and redone (duplicates).
        "rollout": base_cfg.rollout.model_copy(update={
            "generation_batch_size": max(1, base_cfg.train.batch_size // WORKERS), "claim_idle_ms": 600_000}),
        "train": base_cfg.train.model_copy(update={"iterations": iterations}),
        "logging": base_cfg.logging.model_copy(update={"progress": False}),
        "eval": base_cfg.eval.model_copy(update={"enabled": False}),
    })
    config_path = run_dir / "run.yaml"
    config_path.write_text(dump_config(cfg))
    load_config(config_path)  # what the children load must validate
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           **(queue_env or {})}
    py = sys.executable
    sup = Supervisor(run_dir / "logs")
    used = teachers[:n_teachers]
    try:
        workers = []
        for i in range(WORKERS):
            target = used[i % len(used)].target
            workers.append(sup.start(f"rollout-w{i}", [py, "-m", "eopd_trainer.rollout", "--config", str(config_path),
                                                      "--worker-id", f"w{i}", f"teacher.target={target}"], env))
        learner = sup.start("learner", [py, "-m", "eopd_trainer.learner", "--config", str(config_path)], env)
        procs = {"learner": learner.popen.pid, **{w.name: w.popen.pid for w in workers},
                 **{f"teacher{i}": t.child.popen.pid for i, t in enumerate(teachers)}}
        metrics = run_dir / "train_metrics.jsonl"
        deadline = time.monotonic() + timeout
        start = end = None
        while True:
            recs = _iteration_records(metrics)
            if start is None and len(recs) >= 1:
                start = _snapshot(procs, used, len(recs))
            if len(recs) >= iterations:
                end = _snapshot(procs, used, len(recs))
                break
            if not learner.alive():
                raise learner.failure("exited before its last iteration")
            sup.check(allowed_done=tuple(w.name for w in workers))
            if time.monotonic() > deadline:
                raise learner.failure(f"did not finish {iterations} iterations within {timeout:.0f} s")
            time.sleep(0.1)
        learner.popen.wait(120)
        if learner.popen.returncode != 0:
            raise learner.failure("failed")
    finally:
        sup.stop_all()
    if start.records != 1:
        raise RuntimeError(f"{tag}: missed the end of iteration 1 (first seen {start.records} records); "
                           "the measurement window would be wrong")
    recs = _iteration_records(metrics)
    window = [r for r in recs if r["iteration"] >= 2]
    wall = window[-1]["time"] - recs[0]["time"]  # learner's own clock: end of iteration 1 -> end of N
    tokens = sum(r["iter/response_length_mean"] * cfg.train.batch_size for r in window)
    wait = sum(r["iter/queue_wait_s"] for r in window)
    it_s = sum(r["iter/iteration_s"] for r in window)
    snap_s = end.t - start.t
    busy = [(e["engine_s"] - s["engine_s"]) / snap_s for s, e in zip(start.teachers, end.teachers)]
    t_tokens = sum(e["tokens_scored"] - s["tokens_scored"] for s, e in zip(start.teachers, end.teachers))
    cpu = {n: end.proc_cpu[n] - start.proc_cpu[n] for n in procs}
    pipeline_cpu = sum(v for n, v in cpu.items() if not n.startswith("teacher") or int(n[7:]) < n_teachers)
    m_busy = (end.machine[0] - start.machine[0]) / max(1.0, end.machine[1] - start.machine[1])
    return {
        "mode": mode, "teachers": n_teachers, "workers": WORKERS, "iterations_measured": len(window),
        "wall_s": wall, "trained_tokens": tokens, "trained_tok_s": tokens / wall,
        "learner_idle_frac": wait / it_s, "learner_collect_frac": sum(r["iter/collect_s"] for r in window) / it_s,
        "queue_wait_s": wait, "iteration_s_mean": it_s / len(window),
        "teacher_busy": busy, "teacher_busy_mean": sum(busy) / len(busy), "teacher_tok_s": t_tokens / snap_s,
        "staleness_mean": sum(r["iter/staleness_mean"] for r in window) / len(window),
        "stale_dropped_total": window[-1]["iter/stale_dropped_total"],
        "cpu_s": cpu, "pipeline_cpu_s_per_1k_tokens": 1000 * pipeline_cpu / tokens,
        "pipeline_cores_used": pipeline_cpu / snap_s, "machine_busy_frac": m_busy,
        "loadavg_end": list(os.getloadavg()),
    }


def render(results: list[dict], args, preset: str, load_start: str, elapsed: float, data: dict | None = None) -> str:
    """Aggregates rounds (median per configuration) into the table and the docs section. `data`:
    the results JSON being rendered (its machine, commit, time and load average are used, not
    this machine's); None while measuring."""
    import statistics

    from bench.report import header_line

    keys = sorted({(r["mode"], r["teachers"]) for r in results}, key=lambda k: (k[0] != "sync", k[1]))
    rows, agg = [], []
    for mode, nt in keys:
        rs = [r for r in results if (r["mode"], r["teachers"]) == (mode, nt)]

        def med(k, rs=rs):
            return statistics.median(r[k] for r in rs)

        a = {"mode": mode, "teachers": nt, "rounds": len(rs), **{k: med(k) for k in (
            "trained_tok_s", "teacher_tok_s", "learner_idle_frac", "teacher_busy_mean", "pipeline_cpu_s_per_1k_tokens",
            "pipeline_cores_used", "machine_busy_frac", "staleness_mean", "iteration_s_mean")}}
        a["trained_tok_s_all"] = [round(r["trained_tok_s"], 1) for r in rs]
        a["learner_idle_all"] = [round(r["learner_idle_frac"], 3) for r in rs]
        agg.append(a)
        rows.append([mode, nt, f"{a['trained_tok_s']:.1f}", " / ".join(f"{x:.1f}" for x in a["trained_tok_s_all"]),
                     f"{a['teacher_tok_s']:.1f}", f"{100 * a['learner_idle_frac']:.0f}%",
                     " / ".join(f"{100 * x:.0f}%" for x in a["learner_idle_all"]),
                     f"{100 * a['teacher_busy_mean']:.0f}%", f"{a['iteration_s_mean']:.1f}",
                     f"{a['staleness_mean']:.2f}", f"{a['pipeline_cpu_s_per_1k_tokens']:.1f}",
                     f"{a['pipeline_cores_used']:.2f}", f"{100 * a['machine_busy_frac']:.0f}%"])
    headers = ["mode", "teachers", "trained tok/s (median)", "per round", "teacher-scored tok/s", "learner idle",
               "per round", "teacher busy (per teacher)", "s / iteration", "staleness", "CPU s / 1k tok (pipeline)",
               "cores used (pipeline)", "machine busy"]
    table = markdown_table(headers, rows)
    by = {(a["mode"], a["teachers"]): a for a in agg}
    cores = _cores(data) if data else os.cpu_count()
    reading = _reading(by, cores)
    cmd = f"`.venv/bin/python -m bench.bench_pipeline{' --quick' if args.quick else ''}{f' --rounds {args.rounds}' if args.rounds != 1 else ''}`"
    head = header_line(cmd, data) if data else f"{cmd} on {machine_description()}."
    load_end = (data.get("load_end") or "not recorded by this run") if data else _loadavg()
    desc = PRESETS[preset][2]
    section = f"""## Pipeline: end to end, sync vs async, one vs two teachers (issue 9)

{head}
Real processes as `eopd run` starts them: Redis, {'one or two' if len({k[1] for k in keys}) > 1 else 'the'} `eopd-teacher serve` process(es), {WORKERS} `eopd-rollout`
workers (with two teachers, worker i streams to teacher i), one DeepSpeed `eopd-train` learner (ZeRO-0, fp32, CPU).
Preset `{preset}`: {desc}; {args.iterations or PRESETS[preset][1]} iterations per configuration, of which iterations 2..N are measured
(iteration 1 includes start-up). Every process runs with {args.threads} torch thread(s) (`OMP_NUM_THREADS`, teacher `--threads`);
the machine has {cores} cores for all of them. {args.rounds} round(s), configurations interleaved (the order reversed
every other round); medians over rounds, every round listed. Load average at the start: {load_start}; at the end:
{load_end}. Total time {elapsed / 60:.1f} min.

- **trained tok/s**: response tokens the learner trained on per second of its wall time (end to end: sampling,
  scoring, Redis, training, checkpoints, weight publication); **teacher-scored tok/s**: what the teachers scored in the
  same window (more than trained when rollouts are published ahead or dropped as stale);
- **learner idle**: time the learner spent blocked on the rollouts stream (`iter/queue_wait_s`, new in the learner's
  metrics) / its wall time; **teacher busy**: engine seconds / wall seconds per teacher in use (from `/metrics`);
- **CPU s / 1k tok**: CPU seconds of the learner, the workers and the teachers in use (/proc) per 1k trained tokens,
  less sensitive to other people's load than the rates; **machine busy**: the whole machine's CPU busy share
  (/proc/stat), ours and everybody else's; **cores used**: our processes' CPU seconds per wall second.

{table}

{reading}
"""
    return section, agg


def _cores(data: dict) -> int:
    """The core count of the machine a results JSON was measured on."""
    if data.get("cores"):
        return int(data["cores"])
    m = re.search(r"(\d+) cores", data.get("machine", ""))
    return int(m.group(1)) if m else os.cpu_count()


def _reading(by: dict, cores: int) -> str:
    """Every sentence follows from the aggregated rows (no claim the numbers do not carry)."""
    def get(mode, nt, k):
        a = by.get((mode, nt))
        return None if a is None else a[k]

    lines = ["**Reading** (generated from this section's JSON)."]
    s1, a1 = get("sync", 1, "trained_tok_s"), get("async", 1, "trained_tok_s")
    if s1 and a1:
        lines.append(f"- async vs sync with one teacher: {a1 / s1:.2f}x the trained tok/s; learner idle "
                     f"{100 * get('async', 1, 'learner_idle_frac'):.0f}% vs {100 * get('sync', 1, 'learner_idle_frac'):.0f}%.")
    s2, a2 = get("sync", 2, "trained_tok_s"), get("async", 2, "trained_tok_s")
    if s2 and a2:
        lines.append(f"- async vs sync with two teachers: {a2 / s2:.2f}x; learner idle "
                     f"{100 * get('async', 2, 'learner_idle_frac'):.0f}% vs {100 * get('sync', 2, 'learner_idle_frac'):.0f}%.")
    if s1 and s2:
        lines.append(f"- two teachers vs one: {s2 / s1:.2f}x (sync){f', {a2 / a1:.2f}x (async)' if a1 and a2 else ''}.")
    if by:
        ours = [a["pipeline_cores_used"] for a in by.values()]
        machine = [a["machine_busy_frac"] * cores for a in by.values()]
        others = max(m - o for m, o in zip(machine, ours))
        cpu = [a["pipeline_cpu_s_per_1k_tokens"] for a in by.values()]
        share = ("other processes used at most "
                 f"{max(others, 0.0):.2f} cores beside ours" + (" (little next to ours)" if others < 0.25 else
                                                               ": the absolute rates carry that load"))
        lines.append(f"- Our processes used {min(ours):.2f}-{max(ours):.2f} of the {cores} cores; the whole machine was "
                     f"{min(machine):.2f}-{max(machine):.2f} cores busy, so {share}. Work per trained token: "
                     f"{min(cpu):.1f}-{max(cpu):.1f} CPU s per 1k tokens over all our processes.")
    asyncs = [(nt, by[("async", nt)]) for nt in (1, 2) if ("async", nt) in by]
    if asyncs:
        worst = max(a["learner_idle_frac"] for _, a in asyncs)
        busy = ", ".join(f"{100 * a['teacher_busy_mean']:.0f}% with {nt} teacher{'s' if nt > 1 else ''}" for nt, a in asyncs)
        line = (f"- Target (issue 9): learner idle <= 10% in async mode when the teacher has capacity: worst "
                f"{100 * worst:.0f}% ({'met' if worst <= 0.10 else 'not met'}); the teachers were busy {busy} of the "
                "time in async mode")
        if all(a["teacher_busy_mean"] < 0.9 for _, a in asyncs) and worst <= 0.10:
            line += (", so the teacher had spare capacity and the learner, not the teacher, set the rate. All processes "
                     f"share the same {cores} cores here, so a second teacher adds no compute; the speed-up of dedicated "
                     "devices is modelled in the projection section, not measured here.")
        else:
            line += "."
        lines.append(line)
    return "\n".join(lines)


def _queue(sup, work: Path, base) -> tuple[str, str, dict[str, str]]:
    """(redis_url, message, env) from `eopd run`'s queue choice: the Redis at $REDIS_URL, else a
    redis-server started here with a random password (`env`: REDIS_PASSWORD for the learner and
    workers, as `eopd run` gives it). The benchmark wants a real Redis (not the embedded stand-in)."""
    from eopd_trainer.job.local_queue import choose_queue

    res = choose_queue(sup, work, base.queue)
    if res.backend == "embedded":
        raise RuntimeError(f"the pipeline benchmark needs a real Redis ({res.message}): install redis-server or set REDIS_URL")
    return res.url, res.message, ({"REDIS_PASSWORD": res.password} if res.password else {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny preset (tiny random models): about a minute and a half")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: smollm2-cpu (tiny with --quick)")
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--teachers", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--iterations", type=int, default=0, help="per configuration (default: the preset's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument("--timeout", type=float, default=1800.0, help="per configuration, seconds")
    p.add_argument("--out", type=Path, default=None, help="also write the results JSON here")
    p.add_argument("--no-docs", action="store_true", help="do not write bench/results/pipeline.json or the docs section")
    p.add_argument("--from-json", type=Path, default=None, help="re-render the docs section from a results JSON of a run")
    args = p.parse_args(argv)
    if args.from_json:
        old = json.loads(args.from_json.read_text())
        args.quick, args.iterations, args.threads = old["quick"], old["iterations"], old["threads"]
        args.rounds = 1 + max(r["round"] for r in old["results"])
        section, _ = render(old["results"], args, old["preset"], old["load_start"], old["elapsed_s"], data=old)
        write_section("pipeline", section)
        print(section)
        return 0
    preset = args.preset or ("tiny" if args.quick else "smollm2-cpu")
    config_file, default_iters, _ = PRESETS[preset]
    iterations = args.iterations or default_iters
    if iterations < 2:
        p.error("--iterations must be >= 2 (iteration 1 is not measured)")
    load_start = _loadavg()
    t0 = time.monotonic()
    import signal

    def _interrupt(_sig, _frame):
        raise KeyboardInterrupt  # so that every started process is stopped (finally blocks)

    signal.signal(signal.SIGTERM, _interrupt)

    from eopd_trainer.config import load_config
    from eopd_trainer.job.prepare import prepare
    from eopd_trainer.job.supervisor import Supervisor
    from eopd_trainer.job.teacher_proc import start_teacher

    work = Path(tempfile.mkdtemp(prefix="eopd-bench-pipeline-"))
    base, _facts = prepare(load_config(config_file, [f"run_dir={work / 'prepared'}"]))
    shared = Supervisor(work / "logs")
    results: list[dict] = []
    try:
        redis_url, queue_msg, queue_env = _queue(shared, work, base)
        print(f"[pipeline] {queue_msg}; work dir {work}", flush=True)
        teachers = []
        for i in range(max(args.teachers)):  # port 0 for both servers, read from each teacher's ports file
            child = start_teacher(shared, base.teacher.model, "--threads", str(args.threads), name=f"teacher{i}",
                                  env={"OMP_NUM_THREADS": str(args.threads)}, insecure_no_auth=True)
            gp, hp = child.ports(600)
            teachers.append(Teacher(child, gp, hp))
        for t in teachers:
            t.child.wait_ready(600)
        configs = [(m, n) for m in args.modes for n in args.teachers]
        for rnd in range(args.rounds):
            for mode, nt in (configs if rnd % 2 == 0 else configs[::-1]):
                tag = f"r{rnd}-{mode}-t{nt}"
                print(f"[pipeline] {tag}: {WORKERS} workers, {nt} teacher(s), {iterations} iterations", flush=True)
                r = run_config(base, mode=mode, n_teachers=nt, teachers=teachers, redis_url=redis_url, work=work,
                               threads=args.threads, iterations=iterations, timeout=args.timeout, tag=tag,
                               queue_env=queue_env)
                r["round"] = rnd
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        shared.stop_all()
    elapsed = time.monotonic() - t0
    section, agg = render(results, args, preset, load_start, elapsed)
    payload = {"preset": preset, "quick": args.quick, "iterations": iterations, "threads": args.threads,
               "load_start": load_start, "load_end": _loadavg(), "elapsed_s": elapsed, "summary": agg, "results": results}
    print(section)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if not args.quick and not args.no_docs:
        written = json.loads(write_results("pipeline", payload).read_text())
        write_section("pipeline", render(results, args, preset, load_start, elapsed, data=written)[0])
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
