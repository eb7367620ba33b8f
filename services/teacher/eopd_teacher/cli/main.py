"""`eopd-teacher`: serve | info | score | generate.

    eopd-teacher serve --model smollm2-135m --host 127.0.0.1 --grpc-port 50051 --http-port 8000
    eopd-teacher info --target 127.0.0.1:50051
    eopd-teacher score --target 127.0.0.1:50051 --input FILE.jsonl [--output OUT.jsonl]
    eopd-teacher generate --target 127.0.0.1:50051 --input PROMPTS.jsonl [--output OUT.jsonl] (cli/generate.py)

`score` input lines are either token ids, {"id": ..., "token_ids": [...], "score_from": N}, or
text, {"id": ..., "prompt": "...", "response": "..."} (the response's tokens are scored; add
"chat": true to wrap the prompt in the tokenizer's chat template as a user turn).

Text is encoded here, with the tokenizer of `--tokenizer` (a preset, Hugging Face model directory
or .gguf file) or, by default, of the served model found by its name on this machine: that works
for presets and for model paths that mean the same here as on the server (a served .gguf file is
named by its file name only, so pass `--tokenizer` for it). Either way the tokenizer must have the
served model's tokenizer fingerprint, or `score` stops with a message saying so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import grpc

from eopd_common.client_security import ClientSecurity, SecurityFileError
from eopd_common.models import default_cache_dir
from ..settings_base import SettingsError, add_arguments, settings_from_args

from ..client import TeacherClient
from ..settings import TeacherSettings
from .generate import GenerateFailed, add_generate_parser, cmd_generate
from .text import encode_prompt, text_tokenizer


# `serve --auth-token TOKEN` works, but argv is readable by every local user (`ps`, /proc/PID/cmdline);
# the file and the environment variable are not (a 0600 file; /proc/PID/environ is the owner's only).
ARGV_TOKEN_WARNING = (
    "eopd-teacher serve: warning: --auth-token puts the token in this process's command line, which every "
    "local user can read (ps, /proc/PID/cmdline); use --auth-token-file FILE (mode 0600) or the "
    "EOPD_TEACHER_AUTH_TOKEN environment variable instead"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eopd-teacher", description="eopd teacher scoring service")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC (and HTTP probes/metrics)")
    add_arguments(serve, TeacherSettings)
    info = sub.add_parser("info", help="print what a teacher serves")
    _client_arguments(info)
    info.add_argument("--timeout", type=float, default=30.0)
    score = sub.add_parser("score", help="score a JSONL file, write scores as JSONL")
    _client_arguments(score)
    score.add_argument("--input", required=True, type=Path)
    score.add_argument("--output", default="-", help="output JSONL path, - for stdout")
    score.add_argument("--top-k", type=int, default=0)
    score.add_argument("--temperature", type=float, default=0.0)
    score.add_argument(
        "--tokenizer", default=None,
        help="preset, HF model directory or .gguf file whose tokenizer encodes text input (default: the served model, "
        "looked up by its name here; needed for a served .gguf file or a path that differs on this machine)",
    )
    score.add_argument("--batch-size", type=int, default=16, help="sequences per request")
    score.add_argument("--timeout", type=float, default=300.0)
    add_generate_parser(sub, _client_arguments)
    return p


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="host:port or dns:///name:port")
    p.add_argument("--auth-token-file", type=Path, default=None, help="file with the bearer token (or env EOPD_TEACHER_AUTH_TOKEN)")
    p.add_argument("--tls-ca-file", default=None, help="CA bundle of the server's certificate (turns on TLS)")
    p.add_argument("--tls-cert-file", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default=None, help="client key (mutual TLS)")


def _security(args) -> ClientSecurity:
    """The token (file, else EOPD_TEACHER_AUTH_TOKEN) and TLS files of the command line, read now:
    an unreadable file or an empty token file raises SecurityFileError naming the flag."""
    return ClientSecurity.from_files(auth_token_file=args.auth_token_file, tls_ca_file=args.tls_ca_file,
                                     tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file, field_prefix="--")


def _client(args, security: ClientSecurity, timeout: float) -> TeacherClient:
    return TeacherClient(args.target, timeout=timeout, security=security)


def _encode(rows: list[dict], tokenizer_spec: str | None, info, cache_dir, linenos: list[int] | None = None) -> tuple[list, object]:
    """(id, token_ids, score_from) per row; the tokenizer (or None when all rows are token ids).
    `linenos` are the rows' line numbers in the input file (for messages; default 1, 2, ...)."""
    tok = None
    seqs = []
    linenos = linenos or list(range(1, len(rows) + 1))
    for i, row in enumerate(rows):
        sid = str(row.get("id", i))
        if "token_ids" in row:
            seqs.append((sid, [int(t) for t in row["token_ids"]], int(row.get("score_from", 1))))
            continue
        if "prompt" not in row or "response" not in row:
            raise SystemExit(f"line {linenos[i]}: needs token_ids (+score_from) or prompt and response")
        if tok is None:
            tok = text_tokenizer(tokenizer_spec, info, cache_dir)
        prompt_ids = encode_prompt(tok, row["prompt"], bool(row.get("chat")))
        response_ids = tok(row["response"], add_special_tokens=False)["input_ids"]
        if not prompt_ids:
            raise SystemExit(f"line {linenos[i]}: the prompt encodes to no tokens")
        seqs.append((sid, list(prompt_ids) + list(response_ids), len(prompt_ids)))
    return seqs, tok


class _ScoreFailed(Exception):
    """A request of `score` failed: the message names the input line and the sequence id."""


def _cmd_score(args, security: ClientSecurity) -> int:
    numbered = [(n, line) for n, line in enumerate(args.input.read_text().splitlines(), start=1) if line.strip()]
    linenos = [n for n, _ in numbered]
    rows = [json.loads(line) for _, line in numbered]
    out = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    try:
        with _client(args, security, args.timeout) as client:
            info = client.wait_ready(args.timeout)
            seqs, tok = _encode(rows, args.tokenizer, info, default_cache_dir(), linenos)
            for start in range(0, len(seqs), args.batch_size):
                chunk = seqs[start : start + args.batch_size]
                try:
                    scores = client.score(chunk, top_k=args.top_k, temperature=args.temperature)
                except grpc.RpcError as err:
                    # The server names the failing sequence by its index in the request: map it
                    # back to the input line (the chunk's first line if it names none).
                    m = re.search(r"sequences\[(\d+)\]", err.details() or "")
                    i = start + (int(m.group(1)) if m and int(m.group(1)) < len(chunk) else 0)
                    raise _ScoreFailed(f"line {linenos[i]} (id {seqs[i][0]!r}): {err.code().name}: {err.details()}") from None
                for (sid, ids, score_from), s in zip(chunk, scores, strict=True):
                    record = {
                        "id": sid,
                        "score_from": score_from,
                        "token_ids": ids[score_from:],
                        "token_logprobs": s.token_logprobs.tolist(),
                        "entropies": s.entropies.tolist(),
                        "topk_ids": s.topk_ids.tolist(),
                        "topk_logprobs": s.topk_logprobs.tolist(),
                        "mean_logprob": float(s.token_logprobs.mean()),
                        "mean_entropy": float(s.entropies.mean()),
                    }
                    if tok is not None:
                        record["tokens"] = [tok.decode([t]) for t in ids[score_from:]]
                    out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        # Here, not at the top: the server needs the teacher extra (fastapi, uvicorn,
        # prometheus-client), and `info` and `score` run on the core install.
        from ..server import serve

        if args.auth_token is not None:
            print(ARGV_TOKEN_WARNING, file=sys.stderr)
        try:
            settings = settings_from_args(TeacherSettings, args)
        except SettingsError as exc:
            print(f"eopd-teacher: {exc}", file=sys.stderr)
            return 2
        return serve(settings)
    try:
        security = _security(args)
    except SecurityFileError as exc:
        print(f"eopd-teacher {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "info":
            with _client(args, security, args.timeout) as client:
                print(json.dumps(client.wait_ready(args.timeout).__dict__, indent=2))
            return 0
        if args.command == "generate":
            with _client(args, security, args.timeout) as client:
                return cmd_generate(args, client)
        return _cmd_score(args, security)
    except (_ScoreFailed, GenerateFailed) as exc:
        print(f"eopd-teacher {args.command}: {exc}", file=sys.stderr)
    except grpc.RpcError as err:
        print(f"eopd-teacher {args.command}: {args.target}: {err.code().name}: {err.details()}", file=sys.stderr)
    except TimeoutError as exc:
        print(f"eopd-teacher {args.command}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
