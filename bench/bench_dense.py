"""What the learner pays for each divergence's support (issue 48): the loss's forward + backward
over N response tokens, per member, measured side by side in one process (rounds rotate the order;
the median of `--reps` rounds after a warm-up round), with the ratio to the paper's loss.

    .venv/bin/python -m bench.bench_dense                 # SmolLM2's shapes (V 49152, d 576), N 256
    .venv/bin/python -m bench.bench_dense --tokens 1024 --threads 2
    .venv/bin/python -m bench.bench_dense --quick         # small shapes, seconds; writes nothing

Members: the paper's eopd (sampled-token surrogate + gated forward KL over the teacher's top-16),
eopd's GKD as the presets run it (forward KL over the teacher's top-16 + tail), its reverse KL over
the same support, and TRL's objective (reverse KL over the full vocabulary) with the teacher's rows
given two ways: a precomputed `[N, V]` tensor (the divergence alone) and built from bf16 hidden
states and the teacher's output head on demand, as the learner does (`TeacherLogitRows`: the
projection is redone for each chunk in backward, not kept). The student's side is the learner's
fused path (`compute_loss_from_hidden`: its hidden states and output projection require grad, its
`[N, V]` logits are never kept). A full run writes bench/results/dense_loss.json and the `dense_loss` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.report import markdown_table, measure_and_report
from eopd_common.output_head import HeadInfo, OutputHead, TeacherLogitRows
from eopd_trainer.objective import LossConfig, LossInputs, compute_loss_from_hidden

SHAPES = {"smollm2": {"vocab": 49152, "hidden": 576, "k": 16}, "quick": {"vocab": 4096, "hidden": 64, "k": 16}}
#: member -> (LossConfig overrides, how the teacher's full-vocabulary rows are given: None, "tensor", "rows")
MEMBERS: dict[str, tuple[dict, str | None]] = {
    "eopd (paper, top-16)": ({"variant": "eopd"}, None),
    "gkd forward KL, teacher top-16": ({"variant": "gkd", "gkd_beta": 0.0, "support": "teacher_topk"}, None),
    "gkd reverse KL, teacher top-16": ({"variant": "gkd", "gkd_beta": 1.0, "support": "teacher_topk"}, None),
    "gkd reverse KL, full, [N, V] teacher": ({"variant": "gkd", "gkd_beta": 1.0, "support": "full"}, "tensor"),
    "gkd reverse KL, full, bf16 hidden states": ({"variant": "gkd", "gkd_beta": 1.0, "support": "full"}, "rows"),
}


def inputs(n: int, shape: dict, seed: int = 0) -> dict:
    """Random inputs of the right shapes and scales: the teacher's rows from a bf16 head and hidden
    states (its top-16 and entropies taken from those rows, so every member sees one teacher)."""
    g = torch.Generator().manual_seed(seed)
    v, d, k = shape["vocab"], shape["hidden"], shape["k"]
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(torch.bfloat16)
    hidden = (4.0 * torch.randn(n, d, generator=g)).to(torch.bfloat16)
    head = OutputHead.of(HeadInfo(model="bench@0", vocab_size=v, hidden_size=d, dtype="bfloat16", has_bias=False), weight, None)
    head = OutputHead(head.info, head.weight.float(), None, head.fingerprint)  # as the learner keeps it (teacher_head.head_on)
    rows = TeacherLogitRows(head, hidden, torch.ones(n))
    t_logp = torch.log_softmax(rows(0, n), dim=-1)
    top_lp, top_ids = t_logp.topk(k, dim=-1)
    # The student: the teacher's head and hidden states perturbed (fp32, as the CPU learner trains)
    s_hidden = hidden.float() + 0.5 * torch.randn(n, d, generator=g)
    s_weight = head.weight + 0.02 * torch.randn(v, d, generator=g)
    student = s_hidden @ s_weight.T
    sampled = torch.multinomial(torch.softmax(student, -1), 1, generator=g).squeeze(-1)
    tok = LossInputs(sampled_ids=sampled, old_logprobs=torch.log_softmax(student, -1).gather(-1, sampled[:, None]).squeeze(-1),
                     teacher_logprobs=t_logp.gather(-1, sampled[:, None]).squeeze(-1),
                     teacher_entropies=-(t_logp.exp() * t_logp).sum(-1), teacher_topk_ids=top_ids,
                     teacher_topk_logprobs=top_lp, mask=torch.ones(n, dtype=torch.bool))
    return {"hidden": s_hidden, "weight": s_weight, "tok": tok, "rows": rows, "tensor": rows(0, n)}


def run_member(name: str, data: dict, chunk: int) -> float:
    overrides, teacher = MEMBERS[name]
    cfg = LossConfig(**{"tau": 0.8, "chunk_size": chunk, **overrides})
    tok = data["tok"] if teacher is None else data["tok"].replace(teacher_logits=data[teacher])
    hidden = data["hidden"].clone().requires_grad_(True)
    weight = data["weight"].clone().requires_grad_(True)
    t0 = time.perf_counter()
    loss, _ = compute_loss_from_hidden(hidden, weight, tok, config=cfg)  # the learner's fused path
    loss.backward()
    return time.perf_counter() - t0


def measure(n: int, shape_name: str, reps: int, threads: int, chunk: int) -> dict:
    torch.set_num_threads(threads)
    data = inputs(n, SHAPES[shape_name])
    names = list(MEMBERS)
    times: dict[str, list[float]] = {m: [] for m in names}
    for r in range(reps + 1):  # round 0 warms up
        order = names[r % len(names):] + names[: r % len(names)]
        for m in order:
            s = run_member(m, data, chunk)
            if r:
                times[m].append(s)
    med = {m: statistics.median(v) for m, v in times.items()}
    ref = med[names[0]]
    return {"tokens": n, "shape": {"name": shape_name, **SHAPES[shape_name]}, "threads": threads, "chunk": chunk,
            "reps": reps, "members": [{"member": m, "seconds": med[m], "all": times[m], "vs_eopd": med[m] / ref}
                                      for m in names]}


def section_text(data: dict) -> str:
    sh = data["shape"]
    rows = [[m["member"], f"{m['seconds']:.3f}", f"{m['vs_eopd']:.2f}x",
             f"{min(m['all']):.3f}-{max(m['all']):.3f}"] for m in data["members"]]
    return ("## Loss over each support: the learner's cost (`python -m bench.bench_dense`, issue 48)\n\n"
            f"Forward + backward of the loss alone over N = {data['tokens']} response tokens, V {sh['vocab']}, d "
            f"{sh['hidden']} ({sh['name']}), the learner's fused path (student hidden states and output projection "
            f"requiring grad), {data['threads']} thread(s), "
            f"chunks of {data['chunk']} rows; median of {data['reps']} rounds after a warm-up, members interleaved in one "
            f"process (load {data.get('load_avg')}).\n\n"
            + markdown_table(["member", "seconds", "vs eopd", "range"], rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_dense", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None, help="N (default 256; --quick 64)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=256, help="rows per chunk of the full-vocabulary divergence")
    p.add_argument("--quick", action="store_true", help="small shapes; writes nothing (or --out)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    n = args.tokens or (64 if args.quick else 256)
    shape = "quick" if args.quick else "smollm2"
    return measure_and_report("dense_loss", lambda: measure(n, shape, args.reps, args.threads, args.chunk), section_text,
                              quick=args.quick, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
