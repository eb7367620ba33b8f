"""The worker's teachers (issue 32): `prompt_routes`, the teacher of each prompt (`route:` on a
field of its data record), and `TeacherLink`, one per teacher a route reaches: its client and
checks, the requests it is sent (`RequestShaper`, `BatchQueue`), its answers (`ScoreAnswers`) and
its generations (`TeacherGenerator`, `TeacherSamples`). A single-teacher run has one link, `teacher`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eopd_teacher.client import AsyncTeacherClient

from ..config import RouteConfig, RunConfig, TeacherConfig
from ..config.teachers import teacher_key as key_of  # the config key of a teacher's section
from ..data import read_records
from ..teacher_context import TeacherPrompts
from .answers import ScoreAnswers
from .mixture_join import MixtureJoin
from .requests import BatchQueue, RequestShaper, TeacherSource, TokenRemap
from .teacher_checks import check_teacher
from .teacher_gen import TeacherGenerator
from .teacher_samples import TeacherSamples
from .teacher_wait import wait_for_teacher

log = logging.getLogger("eopd.rollout")


def prompt_routes(route: RouteConfig, paths: Sequence[Path], num_prompts: int) -> list[str]:
    """The teacher's name of every prompt (the order of `data.load_prompts` over `paths`); with
    route.mixture, its first teacher's (every teacher of the mixture scores every prompt)."""
    if route.mixture:
        return [next(iter(route.mixture))] * num_prompts
    if not route.field:
        return [route.default] * num_prompts
    names = [route.teacher_of(rec) for path in paths for rec in read_records(path)]
    if len(names) != num_prompts:
        raise ValueError(f"{len(names)} records for {num_prompts} prompts")
    return names


@dataclass
class TeacherLink:
    """One teacher of the worker, connected and checked."""

    name: str
    cfg: TeacherConfig
    client: AsyncTeacherClient
    shaper: RequestShaper
    queue: BatchQueue
    answers: ScoreAnswers
    samples: TeacherSamples
    stream: AsyncIterator

    async def close(self) -> None:
        await self.client.close()


async def connect(name: str, cfg: RunConfig, worker, on_stall: Callable, join: MixtureJoin | None = None) -> TeacherLink:
    """Connects to teacher `name` (`cfg.all_teachers()[name]`), waits for it and checks it against
    the run (tokenizer, limits); raises StopRequested when a stop signal comes first. `worker`: the
    RolloutWorker (tokenizer, prompts, sampler, students, grader, publisher, task book, versions,
    metrics, stop event); `join`: route.mixture's (its answers are joined there)."""
    t = cfg.all_teachers()[name]
    security = t.client_security()  # token / TLS files: read now, fail at start if unreadable
    client = AsyncTeacherClient(t.target, timeout=t.timeout_s, retry_timeout=t.retry_timeout_s, security=security)
    try:
        info = await wait_for_teacher(client, t, worker.stop)
        model = check_teacher(info, cfg, worker.tokenizer, worker.worker_id, t, key_of(name))
    except BaseException:
        await client.close()
        raise
    # only the prompts routed to this teacher need its template's fields (eopd run checks them before it starts)
    prompts = TeacherPrompts(worker.tokenizer, cfg.data, t.prompt_template or None, worker.prompts,
                             asks=lambda rec: cfg.route.asks(name, rec), key=key_of(name))
    if prompts.privileged:
        first = next((i for i, text in enumerate(prompts.texts) if text is not None), None)
        if first is not None:
            log.info("%s.prompt_template: the teacher sees its own prompt, e.g. %r for the student's %r", key_of(name),
                     prompts.texts[first], worker.prompts[first])
    source = TeacherSource(name, model, TokenRemap.of(t.token_remap))
    # Request ids unique per teacher too: two named teachers may be one server (e.g. with and without a template).
    rid_prefix = worker.worker_id if name == "teacher" else f"{worker.worker_id}-{name}"
    shaper = RequestShaper(rid_prefix, t, info.max_tokens_per_request or None, prompts, info.max_context_length)
    queue = BatchQueue(maxsize=max(2, t.max_in_flight))
    # on_error="yield": a request the teacher rejects for good (invalid, over a per-request limit) comes
    # back as (request_id, RequestFailed) and the streams go on. A stall (no answer for timeout_s) makes
    # the client reconnect and re-send (`on_stall`); after retry_timeout_s without any answer it raises
    # StreamStalled.
    stream = client.score_stream(queue, max_in_flight=t.max_in_flight, streams=t.streams, on_error="yield",
                                 stall_timeout_s=t.timeout_s, give_up_s=t.retry_timeout_s, on_stall=on_stall)
    generator = TeacherGenerator(client, cfg, sorted(worker.sampler.stop), worker.worker_id, prompts, t, name)
    samples = TeacherSamples(generator, model, worker.students.prompt_ids, worker.grader, worker.publisher, worker.book,
                             worker.versions, worker.metrics)
    answers = ScoreAnswers(shaper, source, worker.publisher, worker.book, worker.metrics, join)
    return TeacherLink(name, t, client, shaper, queue, answers, samples, stream)
