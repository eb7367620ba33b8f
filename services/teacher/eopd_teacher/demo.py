"""The main job for now: start the teacher on the packaged SmolLM2 model, score an example file
over gRPC, print a per-token view, stop the server.

    python -m eopd_teacher.demo [--input examples/score_example.jsonl] [--output runs/demo/scores.jsonl]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _show(path: Path) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(path.read_text())
        return
    console = Console()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        table = Table(title=f"{rec['id']}: mean log-prob {rec['mean_logprob']:.3f}, mean entropy {rec['mean_entropy']:.3f} nats")
        for col in ("token", "log p(token)", "entropy", "teacher top-3 (id: log p)"):
            table.add_column(col)
        tokens = rec.get("tokens") or [str(t) for t in rec["token_ids"]]
        for i, tok in enumerate(tokens):
            top = ", ".join(f"{t}: {lp:.2f}" for t, lp in zip(rec["topk_ids"][i][:3], rec["topk_logprobs"][i][:3], strict=True))
            ent = rec["entropies"][i]
            table.add_row(repr(tok), f"{rec['token_logprobs'][i]:.3f}", f"[bold]{ent:.3f}[/bold]" if ent >= 0.8 else f"{ent:.3f}", top)
        console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd-demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--input", type=Path, default=Path("examples/score_example.jsonl"))
    p.add_argument("--output", type=Path, default=Path("runs/demo/scores.jsonl"))
    args = p.parse_args(argv)
    gp, hp = _free_port(), _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "eopd_teacher.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
         "--grpc-port", str(gp), "--http-port", str(hp)],
    )
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        print(f"[demo] teacher {args.model} starting on 127.0.0.1:{gp} (metrics on http://127.0.0.1:{hp}/metrics)")
        from .cli import main as cli_main

        started = time.monotonic()
        code = cli_main(["score", "--target", f"127.0.0.1:{gp}", "--input", str(args.input), "--output", str(args.output), "--top-k", "16"])
        if code != 0:
            return code
        print(f"[demo] scored {args.input} in {time.monotonic() - started:.1f}s (incl. model load) -> {args.output}")
        _show(args.output)
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
