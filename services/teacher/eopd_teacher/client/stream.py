"""The ScoreStream machinery of AsyncTeacherClient (TeacherClient's, one call with no re-sending,
is `sync_stream.py`).

`score_stream` is AsyncTeacherClient.score_stream: a `_StreamRun` reads the source in one feeder
task and spreads the requests over `streams` lanes (`_Lane`); each lane runs its calls (`_LaneCall`)
one after the other, and every new call of a lane first re-writes what the lane has unanswered. That
is the one re-send path: after a retryable break (the lane's own retry loop), and after a stall
(with `stall_timeout_s`: the teacher said nothing for that long with requests outstanding; `_watch`
reconnects the client and restarts the lanes). A lane closed by the server with nothing of it in
flight (its idle timeout) re-opens when it has work again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc

from eopd.v1 import teacher_pb2 as pb

from ..convert import STREAM_ENDING_KEY, scores_from_pb
from ..types import SequenceScores
from .channel import Backoff, StreamTransport
from .requests import RequestFailed, ScoreBatch, status_code, build_request



# -- the asyncio client's streams --------------------------------------------------------------
class StreamStalled(RuntimeError):
    """AsyncTeacherClient.score_stream heard nothing from the teacher for `give_up_s` with
    requests outstanding (reconnecting after each stall did not help)."""


@dataclass(frozen=True)
class StallReport:
    """What `on_stall` is given at each stall, before the client reconnects and re-sends.

    `silent_s`: seconds the teacher had been silent (since its last message, or since the oldest
    outstanding write if later); `outstanding`: requests taken from the source and not answered
    yet (all re-sent); `restarts`: stalls of this score_stream so far, this one included;
    `stall_timeout_s` and `target`: the settings, for a log line."""

    silent_s: float
    outstanding: int
    restarts: int
    stall_timeout_s: float
    target: str


class _Lane:
    """One ScoreStream call (re-opened after a retryable break or a stall) and the requests
    assigned to it."""

    def __init__(self, index: int):
        self.index = index
        self.unanswered: dict[str, pb.ScoreRequest] = {}
        self.todo: asyncio.Queue = asyncio.Queue()  # requests to write on the current call
        self.timers: dict[str, asyncio.TimerHandle] = {}  # in-band retries waiting for their backoff
        self.retries: dict[str, Backoff] = {}
        self.written_at: dict[str, float] = {}  # written on the current call, not answered: when
        self.backoff: Backoff | None = None  # the retries of the lane's calls (fresh on progress)
        self.task: asyncio.Task | None = None


_CLOSE = object()  # put on a lane's todo: nothing more to write, half-close


class _LaneCall:
    """One ScoreStream call of a lane: `_write` (a task) writes the lane's todo while `read`
    takes the answers.

    The server announces a stream's end (a StreamEnding) before its status; from then on nothing
    more is written and the stream is half-closed, so that no write races the status (grpcio's
    asyncio client would report such a race as INTERNAL instead of the server's status,
    grpc/grpc#36066)."""

    def __init__(self, run: _StreamRun, lane: _Lane, call):
        self.run = run
        self.lane = lane
        self.call = call
        self.todo = lane.todo
        self.ending = asyncio.Event()
        self.writing = False
        self.write_task = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        while not self.ending.is_set():
            req = await self.todo.get()
            if req is _CLOSE:
                break
            if self.ending.is_set() or (isinstance(req, pb.ScoreRequest) and req.request_id not in self.lane.unanswered):
                continue
            self.writing = True
            self.run._written(self.lane, req.request_id)
            await self.call.write(req)
            self.writing = False
        self.writing = True  # cancelling done_writing would cancel the call
        await self.call.done_writing()

    async def _on_ending(self) -> None:
        self.ending.set()
        if not self.writing:  # waiting for work: stop the writer and half-close here
            self.write_task.cancel()
            await asyncio.wait([self.write_task])
            await self.call.done_writing()

    async def read(self) -> None:
        """Takes the answers until the call ends. Returns when the lane is done (the source is
        exhausted and everything answered); raises otherwise (AioRpcError: the call broke)."""
        run, lane = self.run, self.lane
        async for resp in self.call:
            run.last_heard = time.monotonic()
            if resp.HasField("ending"):
                await self._on_ending()
                continue  # the status follows
            if resp.request_id not in lane.unanswered:
                continue  # an answer to a request already answered before a re-send
            lane.backoff = Backoff(run.transport.retry_timeout)  # progress: a fresh retry budget
            if resp.HasField("error"):
                run._in_band(lane, resp)
                continue
            scores = [scores_from_pb(r) for r in resp.results]
            run.events.put_nowait(("result", resp.request_id, scores))
            run._resolved(lane, resp.request_id)  # after the event: it may announce the end
        task = self.write_task
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
        if run.exhausted and not lane.unanswered:
            return
        raise RuntimeError("the teacher closed the stream with requests unanswered")


class _StreamRun:
    """The machinery of AsyncTeacherClient.score_stream: one feeder task reads the source and
    assigns requests to lanes; each lane task runs its ScoreStream calls; with `stall_timeout_s`
    a watch task restarts them on a new channel when the teacher goes silent. All report on
    `events` as ("result" | "failed", request_id, value), ("error", "", exception) or ("done", "", None)."""

    def __init__(self, transport: StreamTransport, batches, *, max_in_flight: int, timeout: float | None, streams: int,
                 stall_timeout_s: float | None = None, give_up_s: float | None = None,
                 on_stall: Callable[[StallReport], None] | None = None):
        self.transport = transport
        self.source = batches.__aiter__() if hasattr(batches, "__aiter__") else _aiter(batches)
        self.slots = asyncio.Semaphore(max_in_flight)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.lanes = [_Lane(i) for i in range(streams)]
        self.events: asyncio.Queue = asyncio.Queue()
        self.inflight: set[str] = set()
        self.exhausted = False
        self.feeder: asyncio.Task | None = None
        self.stall_timeout_s = stall_timeout_s
        self.give_up_s = give_up_s
        self.on_stall = on_stall
        self.watcher: asyncio.Task | None = None
        self.last_heard = time.monotonic()  # the teacher's last message, on any lane
        self.waiting_since: float | None = None  # first write since nothing was unanswered
        self.restarts = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.last_heard = time.monotonic()
        self.feeder = loop.create_task(self._feed())
        for lane in self.lanes:
            lane.task = loop.create_task(self._run_lane(lane))
        if self.stall_timeout_s is not None:
            self.watcher = loop.create_task(self._watch())

    async def stop(self) -> None:
        tasks = [t for t in [self.feeder, self.watcher, *(lane.task for lane in self.lanes)] if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for lane in self.lanes:
            for h in lane.timers.values():
                h.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # -- bookkeeping ------------------------------------------------------------------------
    def _written(self, lane: _Lane, rid: str) -> None:
        now = time.monotonic()
        lane.written_at[rid] = now
        if self.waiting_since is None:
            self.waiting_since = now

    def _resolved(self, lane: _Lane, rid: str) -> None:
        lane.unanswered.pop(rid, None)
        lane.retries.pop(rid, None)
        lane.written_at.pop(rid, None)
        timer = lane.timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        self.inflight.discard(rid)
        if not self.inflight:
            self.waiting_since = None
        self.slots.release()
        self._maybe_close(lane)
        if self.exhausted and not self.inflight:
            self.events.put_nowait(("done", "", None))

    def _maybe_close(self, lane: _Lane) -> None:
        if self.exhausted and not lane.unanswered:
            lane.todo.put_nowait(_CLOSE)

    async def _feed(self) -> None:
        try:
            while True:
                await self.slots.acquire()
                try:
                    batch = await self.source.__anext__()
                except StopAsyncIteration:
                    break
                rid = batch.request_id or uuid.uuid4().hex
                if rid in self.inflight:
                    raise ValueError(f"request_id {rid!r} is already in flight on this score_stream; ids must be unique")
                req = build_request(batch.sequences, top_k=batch.top_k, temperature=batch.temperature, request_id=rid,
                                    hidden_states=batch.hidden_states)
                lane = min(self.lanes, key=lambda ln: (len(ln.unanswered), ln.index))
                self.inflight.add(rid)
                lane.unanswered[rid] = req
                lane.todo.put_nowait(req)
            self.exhausted = True
            for lane in self.lanes:
                self._maybe_close(lane)
            if not self.inflight:
                self.events.put_nowait(("done", "", None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the source failed (or a duplicate id): the caller's error
            self.events.put_nowait(("error", "", exc))

    def _in_band(self, lane: _Lane, resp: pb.ScoreResponse) -> None:
        rid, err = resp.request_id, resp.error
        code = status_code(err.code)
        req = lane.unanswered.get(rid)
        lane.written_at.pop(rid, None)  # answered: not outstanding while it waits for a re-send
        # UNAVAILABLE, or what the server marks retryable (RESOURCE_EXHAUSTED for load only if this
        # client retries overload).
        retryable = (err.retryable or code == grpc.StatusCode.UNAVAILABLE) and not (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and code not in self.transport.retryable
        )
        if req is not None and retryable:
            backoff = lane.retries.setdefault(rid, Backoff(self.transport.retry_timeout))
            delay = backoff.next_delay()
            if delay is not None and self.deadline is not None:
                left = self.deadline - time.monotonic()
                delay = min(delay, left) if left > 0 else None
            if delay is not None:
                todo = lane.todo  # the current call's queue: a new call re-sends it anyway
                lane.timers[rid] = asyncio.get_running_loop().call_later(delay, self._resend, lane, rid, todo)
                return
        self.events.put_nowait(("failed", rid, RequestFailed(rid, code, err.message)))
        self._resolved(lane, rid)  # after the event: it may announce the end

    def _resend(self, lane: _Lane, rid: str, todo: asyncio.Queue) -> None:
        lane.timers.pop(rid, None)
        req = lane.unanswered.get(rid)
        if req is not None and todo is lane.todo:
            todo.put_nowait(req)

    # -- the lanes --------------------------------------------------------------------------
    def _new_call(self, lane: _Lane) -> _LaneCall:
        """A new call for the lane: everything unanswered on it is written first."""
        for h in lane.timers.values():
            h.cancel()
        lane.timers.clear()
        lane.written_at.clear()
        lane.todo = asyncio.Queue()
        for req in lane.unanswered.values():
            lane.todo.put_nowait(req)
        self._maybe_close(lane)
        transport = self.transport
        remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        call = transport.open_stream(metadata=transport.metadata + ((STREAM_ENDING_KEY, "1"),), timeout=remaining)
        return _LaneCall(self, lane, call)

    async def _work_for(self, lane: _Lane) -> bool:
        """Waits until the lane has a request unanswered (True) or the source is exhausted with
        nothing left on the lane (False). The feeder puts every request it assigns on lane.todo;
        what is taken here is still in lane.unanswered, which the next call writes first."""
        while not lane.unanswered:
            if self.exhausted:
                return False
            await lane.todo.get()
        return True

    async def _run_lane(self, lane: _Lane) -> None:
        transport = self.transport
        lane.backoff = Backoff(transport.retry_timeout)
        try:
            while True:
                call = self._new_call(lane)
                try:
                    await call.read()
                    return
                except grpc.aio.AioRpcError as err:
                    call.write_task.cancel()
                    lane.written_at.clear()  # a broken call has nothing outstanding: its retry is below
                    if not lane.unanswered and transport.should_retry(err):
                        # Closed with nothing of ours in flight (the server's stream_idle_timeout_s,
                        # a drain): no request failed, so no retry budget is spent; the lane re-opens
                        # when it has something to send, or ends if the source is done.
                        if not await self._work_for(lane):
                            return
                        lane.backoff = Backoff(transport.retry_timeout)
                        continue
                    delay = lane.backoff.next_delay() if transport.should_retry(err) else None
                    if delay is not None and self.deadline is not None:
                        left = self.deadline - time.monotonic()
                        delay = min(delay, left) if left > 0 else None
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
                finally:
                    if not call.write_task.done():
                        call.write_task.cancel()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.events.put_nowait(("error", "", exc))

    # -- stalls -----------------------------------------------------------------------------
    def _silence(self) -> float | None:
        """Seconds the teacher has been silent with written requests outstanding (None: none)."""
        oldest = min((t for lane in self.lanes for t in lane.written_at.values()), default=None)
        if oldest is None:
            return None
        return time.monotonic() - max(self.last_heard, oldest)

    async def _watch(self) -> None:
        assert self.stall_timeout_s is not None
        try:
            while True:
                await asyncio.sleep(min(1.0, self.stall_timeout_s / 4))
                silent = self._silence()
                if silent is None or silent < self.stall_timeout_s:
                    continue
                await self._on_stalled(silent)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - StreamStalled, or on_stall's error: the caller's
            self.events.put_nowait(("error", "", exc))

    async def _on_stalled(self, silent: float) -> None:
        """Gives up (StreamStalled) after `give_up_s` without a word from the teacher; otherwise
        reports the stall, puts the client on a new channel and restarts the lanes on it (each
        lane's new call re-writes its unanswered requests). The feeder goes on untouched."""
        waited = time.monotonic() - max(self.last_heard, self.waiting_since or self.last_heard)
        if self.give_up_s is not None and waited >= self.give_up_s:
            raise StreamStalled(f"no answer from the teacher at {self.transport.target} for {self.give_up_s:.0f}s "
                                f"with {len(self.inflight)} requests outstanding")
        self.restarts += 1
        if self.on_stall is not None:
            self.on_stall(StallReport(silent_s=silent, outstanding=len(self.inflight), restarts=self.restarts,
                                      stall_timeout_s=self.stall_timeout_s, target=self.transport.target))
        running = [lane for lane in self.lanes if lane.task is not None and not lane.task.done()]
        for lane in running:
            lane.task.cancel()
        if running:
            await asyncio.wait([lane.task for lane in running])
        await self.transport.reconnect()
        loop = asyncio.get_running_loop()
        for lane in running:
            lane.task = loop.create_task(self._run_lane(lane))


async def score_stream(
    transport: StreamTransport,
    batches: AsyncIterable[ScoreBatch] | Iterable[ScoreBatch],
    *,
    max_in_flight: int,
    timeout: float | None,
    streams: int,
    on_error: str,
    stall_timeout_s: float | None,
    give_up_s: float | None,
    on_stall: Callable[[StallReport], None] | None,
) -> AsyncIterator[tuple[str, list[SequenceScores] | RequestFailed]]:
    """The body of AsyncTeacherClient.score_stream (see there)."""
    if on_error not in ("raise", "yield"):
        raise ValueError(f"on_error must be 'raise' or 'yield', not {on_error!r}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, not {streams}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight}")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0, not {stall_timeout_s}")
    if give_up_s is not None and (stall_timeout_s is None or not give_up_s > 0):
        raise ValueError(f"give_up_s ({give_up_s}) must be > 0, with stall_timeout_s set")
    run = _StreamRun(transport, batches, max_in_flight=max_in_flight, timeout=timeout, streams=streams,
                     stall_timeout_s=stall_timeout_s, give_up_s=give_up_s, on_stall=on_stall)
    try:
        run.start()
        while True:
            kind, rid, value = await run.events.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            if kind == "failed" and on_error == "raise":
                raise value
            yield rid, value
    finally:
        await run.stop()


async def _aiter(items: Iterable):
    for item in items:
        yield item
