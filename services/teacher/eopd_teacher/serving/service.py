"""The teacher's service, behind both front ends (gRPC `grpc/servicer.py`, HTTP `http/openai_compat.py`):
score and generate on core types. It owns what a call holds and counts: admission (`validation`,
with the caller's field names), the per-client in-flight tokens, the batcher and Generate's jobs,
and the metrics of what was scored and generated. The front ends only convert shapes."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Iterator

from eopd_common.output_head import OutputHead

from ..types import GenerateItem, GenerateRequest, Generation, ModelInfo, ScoreRequest, SequenceScores
from ..validation import FieldNames, generate_items, score_items
from .batcher import DynamicBatcher, Overloaded
from .state import ServerState
from .status import DeadlinePassed, NotReady, OutputHeadNotServed

# The header (gRPC metadata, HTTP header) a caller names itself with, for per-client limits.
CLIENT_ID_HEADER = "x-eopd-client"


def client_from(given: str | None, peer: str) -> str:
    """The client key of both front ends (gRPC, HTTP): `id:<x-eopd-client>` (at most 128
    characters) when the caller names itself, else its peer address without the port."""
    return f"id:{given}"[:128] if given else peer


def generate_tokens(item: GenerateItem) -> int:
    """What generating `item` holds: (prompt + max_new_tokens) x num_samples tokens."""
    return (len(item.token_ids) + item.max_new_tokens) * item.num_samples


def generate_jobs(items: list[GenerateItem], max_tokens: int) -> Iterator[list[GenerateItem]]:
    """Consecutive runs of `items` of at most `max_tokens` (`generate_tokens`) each, at least one
    item per run: one engine job each, so a large request leaves the engine to scoring batches
    between its jobs, its answers are sent as each job ends, and what is not yet started is
    withdrawn when the caller goes away."""
    job: list[GenerateItem] = []
    used = 0
    for item in items:
        tokens = generate_tokens(item)
        if job and used + tokens > max_tokens:
            yield job
            job, used = [], 0
        job.append(item)
        used += tokens
    if job:
        yield job


class TeacherService:
    """Score and generate for `client` (the per-client limit's and the fair queue's key)."""

    def __init__(self, state: ServerState):
        self.state = state

    def model_info(self) -> ModelInfo:
        """The served model (NotReady while it loads)."""
        if self.state.info is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.state.info

    def output_head(self) -> OutputHead:
        """The served model's output head (NotReady while it loads; OutputHeadNotServed when the
        engine returns no hidden states)."""
        info = self.model_info()
        if not info.output_head_fingerprint:
            raise OutputHeadNotServed(f"the output head is not served by this teacher (engine {info.engine!r} cannot "
                                      "return its final hidden states)")
        return self.state.engine.output_head()

    @contextlib.contextmanager
    def _in_flight(self, client: str, tokens: int, share_key: str | None = None) -> Iterator[None]:
        """Holds `tokens` of `client`'s per-client in-flight budget (Overloaded beyond it, unless
        the client has nothing else in flight), of `share_key`'s share of max_queue_tokens
        (`state.tokens`; Overloaded beyond it unless it has nothing in flight; the total is the
        batcher's queue limit) and the in-flight gauge while the body runs."""
        inflight = self.state.inflight_tokens
        limit = self.state.settings.max_inflight_tokens_per_client
        if inflight.get(client, 0) + tokens > limit and inflight.get(client, 0) > 0:
            raise Overloaded(f"client {client!r} has {inflight[client]} tokens in flight; this request adds {tokens}, limit {limit}")
        shares = self.state.tokens
        key = share_key or client
        if shares.refusal(tokens, key) == "share":
            raise Overloaded(f"client {key} has {shares.held_by(key)} tokens in flight, this request adds {tokens}, its share "
                             f"of max_queue_tokens ({shares.limit} x max_client_share = {shares.share}); retry later")
        shares.take(tokens, key)
        inflight[client] = inflight.get(client, 0) + tokens
        self.state.metrics.inflight.inc()
        try:
            yield
        finally:
            self.state.metrics.inflight.dec()
            shares.give(tokens, key)
            inflight[client] -= tokens
            if inflight[client] <= 0:
                del inflight[client]

    async def score(self, request: ScoreRequest, client: str, names: FieldNames, *,
                    require_request_id: bool = False, share_key: str | None = None) -> list[SequenceScores]:
        """Validates `request` whole (errors naming fields by `names`), queues it on the batcher
        within the client's in-flight budget and `share_key`'s share (`shares.share_key`; None:
        `client`); the scores of its sequences, in order."""
        info, batcher = self.state.check_ready()
        items = score_items(request, info, names, require_request_id=require_request_id,
                            max_response_bytes=self.state.settings.max_message_bytes)
        with self._in_flight(client, sum(it.num_tokens for it in items), share_key):
            results = await batcher.submit(items, client)
        m = self.state.metrics
        m.sequences.inc(len(items))
        m.tokens_scored.inc(sum(it.num_scored for it in items))
        return results

    async def generate(self, request: GenerateRequest, client: str, names: FieldNames,
                       deadline: float | None = None, *, share_key: str | None = None) -> AsyncIterator[Generation]:
        """Validates the whole request, then runs its jobs (`generate_jobs`) one after another on
        the batcher and yields each generation as its job ends (prompt order, samples in order).
        `deadline` (time.monotonic(); None: none): no job starts after it."""
        info, batcher = self.state.check_ready()
        s = self.state.settings
        items = generate_items(request, info, names, max_response_bytes=s.max_message_bytes)
        m = self.state.metrics
        with self._in_flight(client, sum(generate_tokens(it) for it in items), share_key):
            for job in generate_jobs(items, s.max_batch_tokens):
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlinePassed(f"the call's deadline passed before prompt {job[0].prompt_id!r} was generated")
                generations = await self._run_generate_job(batcher, job, deadline)
                m.generations.inc(len(generations))
                m.tokens_generated.inc(sum(len(g.token_ids) for g in generations))
                for g in generations:
                    yield g

    async def _run_generate_job(self, batcher: DynamicBatcher, job: list[GenerateItem], deadline: float | None) -> list[Generation]:
        """One engine job on the batcher (its items' prompts and samples decoded together; in bounded
        steps where the engine has `generate_steps`); the engine is told to stop (`cancelled`) once
        this call is cancelled or its deadline has passed, so an abandoned generation frees the engine."""
        gone = threading.Event()

        def cancelled() -> bool:
            return gone.is_set() or (deadline is not None and time.monotonic() >= deadline)

        engine = self.state.engine
        tokens = sum(generate_tokens(it) for it in job)
        try:
            if engine.generate_steps is not None:  # in bounded steps, scoring batches served between them
                return await batcher.submit_job(functools.partial(engine.generate_steps, job, cancelled=cancelled),
                                                tokens, steps=True)
            return await batcher.submit_job(functools.partial(engine.generate, job, cancelled=cancelled), tokens)
        except BaseException:
            gone.set()
            raise
