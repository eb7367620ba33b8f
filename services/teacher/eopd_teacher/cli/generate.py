"""`eopd-teacher generate`: sample responses for the prompts of a JSONL file, with the teacher's
statistics at every generated position, written as JSONL (one line per generation).

    eopd-teacher generate --target 127.0.0.1:50051 --input prompts.jsonl [--output out.jsonl] \\
        [--max-new-tokens 64 --num-samples 2 --temperature 1.0 --top-p 1.0 --seed 0 --top-k 16 --stop-id ID ...]

Input lines are {"id": ..., "token_ids": [...]} or {"id": ..., "text": "..."} (add "chat": true to
wrap the text in the tokenizer's chat template as a user turn); text is encoded as `score` encodes
it (`--tokenizer`, else the served model's tokenizer found by its name here, checked against the
served fingerprint). Output lines: id, sample_index, token_ids, finish_reason, token_logprobs,
entropies, topk_ids, topk_logprobs (and "text", the decoded response, when a tokenizer was loaded).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import grpc

from eopd_common.models import default_cache_dir

from .text import encode_prompt, text_tokenizer


def add_generate_parser(sub, client_arguments) -> None:
    g = sub.add_parser("generate", help="sample responses for a JSONL file of prompts, write generations and statistics as JSONL")
    client_arguments(g)
    g.add_argument("--input", required=True, type=Path)
    g.add_argument("--output", default="-", help="output JSONL path, - for stdout")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--num-samples", type=int, default=1, help="responses per prompt")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="same seed, same request: same tokens (same engine and hardware)")
    g.add_argument("--top-k", type=int, default=0, help="top tokens returned per position (0: the server default)")
    g.add_argument("--score-temperature", type=float, default=1.0, help="temperature of the returned statistics")
    g.add_argument("--stop-id", type=int, action="append", default=[], help="token id that ends a response (repeatable)")
    g.add_argument("--tokenizer", default=None, help="tokenizer for text input (as for `score`)")
    g.add_argument("--batch-size", type=int, default=16, help="prompts per request")
    g.add_argument("--timeout", type=float, default=600.0)


class GenerateFailed(Exception):
    """A request of `generate` failed: the message names the input line and the prompt id."""


def _prompts(rows: list[dict], linenos: list[int], args, info) -> tuple[list[tuple[str, list[int]]], object]:
    """(id, token ids) per row (ids unique: default the line number) and the tokenizer (None when
    every row gave token ids)."""
    tok = None
    out = []
    seen: dict[str, int] = {}
    for row, lineno in zip(rows, linenos, strict=True):
        pid = str(row.get("id", lineno))
        if pid in seen:
            raise SystemExit(f"line {lineno}: id {pid!r} already used on line {seen[pid]} (output lines are keyed by id)")
        seen[pid] = lineno
        if "token_ids" in row:
            out.append((pid, [int(t) for t in row["token_ids"]]))
            continue
        if "text" not in row:
            raise SystemExit(f"line {lineno}: needs token_ids or text")
        if tok is None:
            tok = text_tokenizer(args.tokenizer, info, default_cache_dir(), "generate")
        out.append((pid, encode_prompt(tok, row["text"], bool(row.get("chat")))))
    return out, tok


def cmd_generate(args, client) -> int:
    """Runs `generate` with an open `client`."""
    numbered = [(n, line) for n, line in enumerate(args.input.read_text().splitlines(), start=1) if line.strip()]
    linenos = [n for n, _ in numbered]
    rows = [json.loads(line) for _, line in numbered]
    info = client.wait_ready(args.timeout)
    prompts, tok = _prompts(rows, linenos, args, info)
    out = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
    try:
        for start in range(0, len(prompts), args.batch_size):
            chunk = prompts[start : start + args.batch_size]
            try:
                gens = client.generate(dict(chunk), num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                                       temperature=args.temperature, top_p=args.top_p, stop_token_ids=args.stop_id,
                                       seed=args.seed, top_k=args.top_k, score_temperature=args.score_temperature)
            except grpc.RpcError as err:  # name the input line of the prompt the server names (else the chunk's first)
                m = re.search(r"prompts\[(\d+)\]", err.details() or "")
                i = start + (int(m.group(1)) if m and int(m.group(1)) < len(chunk) else 0)
                raise GenerateFailed(f"line {linenos[i]} (id {prompts[i][0]!r}): {err.code().name}: {err.details()}") from None
            for g in gens:
                record = {
                    "id": g.prompt_id,
                    "sample_index": g.sample_index,
                    "token_ids": g.token_ids.tolist(),
                    "finish_reason": g.finish_reason,
                    "token_logprobs": g.scores.token_logprobs.tolist(),
                    "entropies": g.scores.entropies.tolist(),
                    "topk_ids": g.scores.topk_ids.tolist(),
                    "topk_logprobs": g.scores.topk_logprobs.tolist(),
                }
                if tok is not None:
                    record["text"] = tok.decode(g.token_ids.tolist())
                out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0

