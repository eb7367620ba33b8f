"""Plain data types of the teacher core (no protobuf here: conversion lives in `convert.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScoreItem:
    """One sequence to score: positions t in [score_from, len(token_ids)) given token_ids[:t]."""

    seq_id: str
    token_ids: np.ndarray  # [L] int64
    score_from: int
    top_k: int
    temperature: float
    # [n, m] int64 per-position candidate ids to score (-1 filler); None: no candidates.
    candidate_ids: np.ndarray | None = None
    # The dtype of the final hidden states to return ("bfloat16", "float32"); "": none.
    hidden_dtype: str = ""

    @property
    def num_candidates(self) -> int:
        return 0 if self.candidate_ids is None else int(self.candidate_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_scored(self) -> int:
        return self.num_tokens - self.score_from


@dataclass(frozen=True)
class SequenceScores:
    """Scores of one sequence, n = number of scored positions, k = top_k."""

    seq_id: str
    token_logprobs: np.ndarray  # [n] float32
    entropies: np.ndarray  # [n] float32
    topk_ids: np.ndarray  # [n, k] int32
    topk_logprobs: np.ndarray  # [n, k] float32
    # [n, m] float32 log-probs of the request's candidate ids (NaN at -1 filler); None: none asked.
    candidate_logprobs: np.ndarray | None = None
    # [n, d] final hidden states packed in `hidden_dtype` (`eopd_common.output_head.pack_hidden`),
    # with the fingerprint of the output head that projects them; None: none asked.
    hidden_states: bytes | None = None
    hidden_dtype: str = ""
    hidden_size: int = 0
    output_head_fingerprint: str = ""

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


@dataclass(frozen=True)
class GenerateItem:
    """One prompt to continue `num_samples` times (a validated GenerateRequest has one per prompt).

    temperature 0 means greedy; top_p 1.0 means off. With `seed` set, sample j of this item is
    drawn from a generator seeded with (seed, item index in the request, j), so the same request
    gives the same tokens on the same engine and hardware. Statistics of the generated positions
    are those `ScoringEngine.score` gives for prompt + generated ids at `score_temperature`."""

    prompt_id: str
    token_ids: np.ndarray  # [P] int64
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    seed: int | None
    top_k: int
    score_temperature: float
    index: int = 0  # position of this prompt in its request (part of the seed)
    hidden_dtype: str = ""  # as ScoreItem's: the generated positions' final hidden states too


@dataclass(frozen=True)
class Generation:
    """One generated response: `token_ids [n]` (without the prompt; ends with the stop/EOS id
    when finish_reason == "stop") and the statistics at those n positions (`scores.seq_id` is
    the prompt id)."""

    prompt_id: str
    sample_index: int
    token_ids: np.ndarray  # [n] int64
    finish_reason: str  # "stop" | "length"
    scores: SequenceScores


class GenerationCancelled(Exception):
    """`ScoringEngine.generate` stopped early: its caller went away or its deadline passed (the
    engine's `cancelled()` returned True)."""


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine serves: the model, its vocabulary and context, the weights' dtype and the
    tokenizer. The server adds its own limits and version to make the `ModelInfo` it answers with
    (`state.served_info`)."""

    model_name: str
    model_revision: str
    vocab_size: int
    max_context_length: int
    dtype: str
    engine: str
    tokenizer_fingerprint: str
    # The final hidden states' width and the output head's fingerprint (GetOutputHead); 0 and ""
    # when the engine cannot return hidden states.
    hidden_size: int = 0
    output_head_fingerprint: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """What GetModelInfo answers (on the wire: `convert.info_to_pb`)."""

    model_name: str
    model_revision: str
    vocab_size: int
    max_context_length: int
    dtype: str
    engine: str
    default_top_k: int
    max_top_k: int
    tokenizer_fingerprint: str
    max_sequences_per_request: int = 0
    max_tokens_per_request: int = 0
    server_version: str = ""
    max_candidates: int = 0
    max_new_tokens: int = 0
    max_generate_samples: int = 0
    hidden_size: int = 0
    output_head_fingerprint: str = ""


# Requests as the service takes them (`validation.py` validates them):
# what a front end (gRPC `convert.py`, HTTP `http/openai_compat.py`) makes of its wire shape. The
# floats are float32 values, the type of the fields on the gRPC wire (the HTTP front end rounds
# its own the same way, so both compute the same statistics); a 0 means "the default".


@dataclass(frozen=True)
class ScoreSequence:
    """One sequence of a ScoreRequest, unvalidated."""

    id: str
    token_ids: np.ndarray  # [L] int64
    score_from: int
    num_candidates: int = 0
    candidate_ids: np.ndarray | None = None  # [n * m] int64, row-major (-1 filler); None: none


@dataclass(frozen=True)
class ScoreRequest:
    """What a Score call asks, unvalidated."""

    sequences: list[ScoreSequence]
    request_id: str = ""
    top_k: int = 0  # 0: the server's default_top_k
    temperature: float = 0.0  # 0: 1.0
    hidden_states: str = ""  # "bfloat16" / "float32": return the final hidden states; "": none


@dataclass(frozen=True)
class GeneratePrompt:
    """One prompt of a GenerateRequest, unvalidated."""

    id: str
    token_ids: np.ndarray  # [P] int64


@dataclass(frozen=True)
class GenerateRequest:
    """What a Generate call asks, unvalidated (fields as `GenerateItem`'s; 0: the default)."""

    prompts: list[GeneratePrompt]
    max_new_tokens: int = 0
    request_id: str = ""
    num_samples: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = 0
    score_temperature: float = 0.0
    hidden_states: str = ""  # as ScoreRequest's
