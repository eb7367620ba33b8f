"""A busy CPU (issue 31, ask 7): the learner's step and the sampler's decode, alone and beside a CPU
hog, for each thread setting of a process, side by side in one run.

Each measurement is a fresh process (OpenMP reads its environment once, at start): it loads the
student, warms up, then times `steps` learner steps (forward + backward of a batch) and `steps`
sampler runs (`generate`, greedy, a batch of prompts). "Beside" runs the same process while a hog
(another torch process doing float32 matmuls on every core, as a second training job would) runs;
the ratio beside / alone is what a busy machine costs. A process that shared the machine fairly with
a hog of as many threads would run about 2x slower; the paths differ in how far above that they go.

Settings (`eopd run` sets the winner for its children):
- **cores**: torch threads = the machine's cores, OpenMP's default wait policy (what a process got
  before: libgomp spins waiting threads for a while before they sleep);
- **passive**: the same thread count, `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep at once);
- **one**: one torch thread.

    .venv/bin/python -m bench.bench_threads [--quick] [--model smollm2-135m] [--rounds 2]

Writes the `threads` section of docs/benchmarks.md (not with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.report import ROOT, markdown_table, measure_and_report

SETTINGS = {
    "cores": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "one": {"threads": "1"},
}
HOG = """
import torch, time
torch.set_num_threads({threads})
a = torch.randn(512, 512)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    a = torch.tanh(a @ a)
"""


def child(model_spec: str, steps: int, batch: int, seq: int, new_tokens: int) -> dict:
    """Runs in the measured process: loads the student, times learner steps and sampler runs."""
    import resource

    import torch

    from eopd_common.models import load_causal_lm

    threads = int(os.environ.get("EOPD_BENCH_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_causal_lm(model_spec).model
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    prompts = torch.randint(0, vocab, (batch, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def learner_step():
        model.train()
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    def sampler_run():
        model.eval()
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)

    out = {"torch_threads": torch.get_num_threads()}
    for name, fn in (("learner", learner_step), ("sampler", sampler_run)):
        fn()  # warm-up
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[f"{name}_s"] = statistics.median(times)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = ru.ru_utime + ru.ru_stime
    return out


def run_child(setting: str, model: str, steps: int, batch: int, seq: int, new_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    extra = dict(SETTINGS[setting])
    env["EOPD_BENCH_THREADS"] = extra.pop("threads", "0")
    env.update(extra)
    args = [sys.executable, "-m", "bench.bench_threads", "--child", json.dumps([model, steps, batch, seq, new_tokens])]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{setting}: the measured process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def hog(threads: int):
    proc = subprocess.Popen([sys.executable, "-c", HOG.format(threads=threads, seconds=3600)], cwd=ROOT,
                            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    try:
        time.sleep(2.0)  # torch imported, the hog at full speed
        yield
    finally:
        proc.kill()
        proc.wait()


def measure(model: str, rounds: int, steps: int, batch: int, seq: int, new_tokens: int,
            hog_threads: int | None = None) -> dict:
    """`hog_threads` (default: every core) is the hog's thread count."""
    cores = os.cpu_count() or 1
    per_round = []
    for r in range(rounds):
        rec: dict = {}
        for setting in SETTINGS:
            alone = run_child(setting, model, steps, batch, seq, new_tokens)
            with hog(hog_threads or cores):
                beside = run_child(setting, model, steps, batch, seq, new_tokens)
            rec[setting] = {"alone": alone, "beside": beside}
        per_round.append(rec)
        print(json.dumps({"round": r, **rec}), flush=True)
    med = statistics.median
    summary = {}
    for setting in SETTINGS:
        for work in ("learner", "sampler"):
            alone = [x[setting]["alone"][f"{work}_s"] for x in per_round]
            beside = [x[setting]["beside"][f"{work}_s"] for x in per_round]
            summary[f"{setting}_{work}_alone_s"] = med(alone)
            summary[f"{setting}_{work}_beside_s"] = med(beside)
            summary[f"{setting}_{work}_ratio"] = med([b / a for a, b in zip(alone, beside)])
    return {"model": model, "cores": cores, "hog_threads": hog_threads or cores, "rounds": per_round, "steps": steps, "batch": batch, "seq": seq,
            "new_tokens": new_tokens, **summary}


def section_text(data: dict) -> str:
    rows = []
    for setting in SETTINGS:
        row = [setting]
        for work in ("learner", "sampler"):
            row += [f"{data[f'{setting}_{work}_alone_s']:.3f}", f"{data[f'{setting}_{work}_beside_s']:.3f}",
                    f"{data[f'{setting}_{work}_ratio']:.2f}x"]
        rows.append(row)
    best = min(SETTINGS, key=lambda s: data[f"{s}_learner_beside_s"] + data[f"{s}_sampler_beside_s"])
    return "\n".join([
        "## A busy CPU: thread settings beside a CPU hog (`python -m bench.bench_threads`, issue 31 ask 7)", "",
        f"{data['model']}, {data['cores']} cores; learner step = forward + backward of {data['batch']} x {data['seq']} "
        f"tokens; sampler = greedy `generate` of {data['batch']} x {data['new_tokens']} tokens after 16-token prompts; "
        f"medians of {data['steps']} after a warm-up, each setting a fresh process, {len(data['rounds'])} rounds "
        f"interleaved; beside = while a hog (torch matmuls on {data.get('hog_threads', data['cores'])} threads) runs. Fair sharing with the hog "
        f"would make a process about 2x slower. Load average {data.get('load_avg', '?')} (1/5/15 min, start -> end).", "",
        markdown_table(["setting", "learner alone s", "learner beside s", "learner beside/alone",
                        "sampler alone s", "sampler beside s", "sampler beside/alone"], rows), "",
        f"Fastest beside the hog (learner + sampler): **{best}**. Settings: cores = torch threads = cores, OpenMP's "
        "default wait policy (spin, then sleep); passive = `OMP_WAIT_POLICY=PASSIVE`; one = one torch thread.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny random model, 1 round; prints, writes nothing")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return 0
    batch, seq, new_tokens, hog_threads = 4, 64, 16, None
    if args.quick:  # a one-thread hog: the smoke checks the wiring, and CI's other tests share the cores
        args.model, args.rounds, args.steps, batch, seq, new_tokens, hog_threads = "tiny-random", 1, 1, 2, 16, 4, 1
    return measure_and_report("threads", lambda: measure(args.model, args.rounds, args.steps, batch, seq, new_tokens,
                                                         hog_threads), section_text, quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
