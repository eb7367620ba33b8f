"""Scoring through eopd's gRPC, eopd's vLLM-compatible `/v1/completions`, and stock vLLM's
`/v1/completions` (with .venv-vllm), same model (SmolLM2-135M-Instruct, float32), same sequences:
scored tokens/s and bytes per scored token.

    .venv/bin/python -m bench.bench_openai_compat [--quick] [--rounds R] [--clients C] [--top-k K]

Both HTTP paths are driven as TRL 1.16's `VLLMClient.get_sequence_logprobs` drives them (the whole
sequence as the prompt, `max_tokens` 1, `prompt_logprobs` k; the client sorts each position by rank
and keeps the completion positions: `bench_trl_peer.CompletionsPath`); gRPC scores the completion
positions. "Scored tokens" are the completion positions in every path. Bytes: the response body
(serialized protobuf; JSON), transport headers excluded. Paths are measured in interleaved rounds;
the stock vLLM server runs in a phase of its own (an idle vLLM takes CPU from the others).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.bench_trl_peer import CompletionsPath, GrpcPath, first_sequence, measure, start_vllm_server, workload
from bench.report import ROOT, header_line, markdown_table, write_results, write_section

PATHS = ("eopd gRPC", "eopd /v1/completions", "stock vLLM /v1/completions")
RETURNS = {
    "eopd gRPC": "token log-prob, exact entropy, top-k (packed protobuf), completion positions only",
    "eopd /v1/completions": "vLLM's JSON (every prompt position, decoded tokens) + exact entropy (`prompt_entropies`)",
    "stock vLLM /v1/completions": "vLLM's JSON (every prompt position, decoded tokens), no entropy",
}


def _rows(results: dict, sizes: dict, scored: int) -> list[list]:
    rows = []
    for name in PATHS:
        if name not in results:
            continue
        tok_s = statistics.median(r["tok_s"] for r in results[name])
        server = statistics.median(r["server_cpu_s_per_1k"] for r in results[name])
        rows.append([name, f"{tok_s:.0f}", f"{server:.2f}", f"{sizes[name][0] / scored:.0f}", f"{sizes[name][1] / scored:.1f}",
                     RETURNS[name]])
    return rows


def render(data: dict) -> str:
    cmd = f"`.venv/bin/python -m bench.bench_openai_compat{' --quick' if data['quick'] else ''}`"
    table = markdown_table(["path", "scored tok/s (median)", "server CPU s / 1k tok", "response B / scored tok",
                            "request B / scored tok", "returns"], _rows(data["results"], data["sizes"], data["scored"]))
    agree = ", ".join(f"{k} {v:.2g}" for k, v in sorted(data["agreement"].items()))
    missing = f"\n\nStock vLLM rows missing: {data['vllm_error']}." if data.get("vllm_error") else ""
    return (f"## vLLM-compatible scoring: eopd gRPC vs eopd /v1/completions vs stock vLLM\n\n{header_line(cmd, data)}\n\n"
            f"{data['n_seqs']} sequences x {data['length']} tokens (prompt {data['prompt']}, {data['scored']} scored positions "
            f"per request), top-k {data['top_k']}, {data['clients']} client threads x {data['per_client']} requests, "
            f"{data['rounds']} interleaved rounds.\n\n{table}\n\nAgreement with eopd gRPC (max |diff| of the top-k log-probs): "
            f"{agree}. eopd's two paths share one server and are interleaved; stock vLLM runs in a later phase, so its "
            f"row and theirs may have seen different loads on a shared machine (server CPU per token is the steadier "
            f"comparison). Response bytes: JSON for every prompt position (what TRL's client asks), against packed "
            f"protobuf for the scored positions only.{missing}\n")


def _phase(sup_dir: Path, paths: dict, pids: dict, results: dict, sizes: dict, agree: dict, grpc_first, args, scored) -> None:
    n = grpc_first.token_logprobs.shape[0]
    for name, pth in paths.items():
        sizes[name] = pth.sizes()  # also the warm-up
        if name != "eopd gRPC":
            got = first_sequence(pth.one(), args.top_k)
            agree[name] = float(np.abs(got["logprobs"][:n] - grpc_first.topk_logprobs).max())
        results[name] = []
    for rnd in range(args.rounds):
        for name in (list(paths) if rnd % 2 == 0 else list(paths)[::-1]):
            r = measure(paths[name], pids[name], args.clients, args.per_client, scored)
            results[name].append({**r, "round": rnd})
            print(json.dumps({"path": name, **r}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = ap.parse_args(argv)
    n_seqs, length, prompt = (4, 128, 32) if args.quick else (8, 256, 64)
    if args.quick:
        args.rounds, args.per_client = 1, 1
    seqs = workload(n_seqs, length, prompt, seed=0)
    scored = n_seqs * (length - prompt)

    from eopd_trainer.job.supervisor import Supervisor, free_port, wait_http_ready
    from eopd_trainer.job.teacher_proc import start_teacher

    work = Path(tempfile.mkdtemp(prefix="eopd-bench-compat-"))
    results: dict = {}
    sizes: dict = {}
    agree: dict = {}
    sup = Supervisor(work / "logs")
    try:
        teacher = start_teacher(sup, "smollm2-135m", "--dtype", "float32", "--max-top-k", str(max(args.top_k, 64)),
                                name="eopd-teacher", insecure_no_auth=True)
        teacher.wait_ready(600)
        paths = {"eopd gRPC": GrpcPath(teacher.target, seqs, args.top_k),
                 "eopd /v1/completions": CompletionsPath(teacher.http_url, "smollm2-135m", seqs, args.top_k)}
        grpc_first = paths["eopd gRPC"].one()[0]
        _phase(work, paths, dict.fromkeys(paths, teacher.popen.pid), results, sizes, agree, grpc_first, args, scored)
    finally:
        sup.stop_all()
    vllm_error = ""
    vllm_py = Path(args.vllm_python)
    if vllm_py.is_file():
        sup = Supervisor(work / "logs-vllm")
        try:
            port = free_port()
            child = start_vllm_server(sup, port, vllm_py)
            wait_http_ready(child, f"http://127.0.0.1:{port}/health", timeout=900)
            name = "stock vLLM /v1/completions"
            _phase(work, {name: CompletionsPath(f"http://127.0.0.1:{port}", "teacher", seqs, args.top_k)},
                   {name: child.popen.pid}, results, sizes, agree, grpc_first, args, scored)
        except Exception as exc:  # noqa: BLE001 - optional rows: say why they are missing
            vllm_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            sup.stop_all()
    else:
        vllm_error = f"{vllm_py} not found (bash scripts/vllm_env.sh --setup-only installs it)"
    data = {"quick": args.quick, "n_seqs": n_seqs, "length": length, "prompt": prompt, "scored": scored, "top_k": args.top_k,
            "clients": args.clients, "per_client": args.per_client, "rounds": args.rounds, "results": results,
            "sizes": sizes, "agreement": agree, "vllm_error": vllm_error}
    if not args.quick:
        path = write_results("openai_compat", data)
        data = json.loads(path.read_text())
        write_section("openai_compat", render(data))
    if args.quick:
        print(markdown_table(["path", "tok/s", "server CPU s/1k", "response B/tok", "request B/tok", "returns"],
                             _rows(results, sizes, scored)))
        print(json.dumps({"agreement": agree, "vllm_error": vllm_error}))
    else:
        print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
