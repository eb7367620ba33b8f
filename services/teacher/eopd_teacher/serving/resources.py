"""The teacher process's share of the machine: open files and memory returned after bursts.

- `raise_open_file_limit()`: the soft RLIMIT_NOFILE raised to the hard limit at start, so that a
  burst of connections (or a slow-header attack) meets the server's own limits (HTTP header
  timeout and connection limit, gRPC's concurrent-call limit) rather than EMFILE on accept, which
  also starves the gRPC side and the probes (issue 17, section 3).
- `MemoryReturner`: glibc keeps freed heap memory in its arenas, so a burst of large requests left
  the process's RSS at its peak for good (issue 17, section 2: 6.5 GB kept after 16 x 63 MiB).
  At start, large allocations (>= `eopd_common.memory.MMAP_THRESHOLD`) are pinned to mmap (glibc otherwise raises that
  threshold dynamically after the first large free, and later large buffers stay on the heap);
  after large messages, a garbage collection frees what reference cycles still hold (an aborted
  call's exception keeps its frames, and so the request, until a full collection, which a process
  with torch's hundreds of thousands of objects seldom runs), then `malloc_trim(0)` hands the
  arenas' free pages back (in a thread). A pass runs `DELAY_S` after the last large message of a
  burst, and at least every `MIN_INTERVAL_S` during a long one (and never more often). On a C library without these calls (musl, macOS)
  only the collection runs.
- `ByteBudget`: the request bytes admitted and not yet answered, across every unary call and
  ScoreStream, bounded in total by `max_inflight_request_bytes` (issue 17, section 2): per-call
  and per-stream limits alone let 1024 streams x 64 requests each hold gigabytes.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import resource
import time

from eopd_common.memory import libc, resident_bytes, return_large_frees

from .shares import PerClientLimit

log = logging.getLogger("eopd_teacher")

# A request message at least this large schedules a trim once it is done with.
LARGE_MESSAGE_BYTES = 1 << 20
# A pass runs once no large message has been done with for this long...
DELAY_S = 0.5
# ...or this long after the first pending one, and at most once per this many seconds (a garbage
# collection takes ~0.1 s with torch loaded).
MIN_INTERVAL_S = 2.0


# The resident memory is checked this often; a growth this large since the last pass runs one.
WATCH_INTERVAL_S = 5.0
WATCH_GROWTH_BYTES = 32 << 20


def raise_open_file_limit() -> tuple[int, int]:
    """Raises the soft open-file limit to the hard one; returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. macOS refuses RLIM_INFINITY: keep the soft limit
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


class ByteBudget:
    """Request bytes (their wire size) admitted and not yet answered, at most `limit` in total and
    `max(1, limit x share_fraction)` per client (`shares.PerClientLimit`; a taker without a
    `client` counts against the total only).

    The interceptor takes a unary call's bytes once its body is read (refusing the call with
    RESOURCE_EXHAUSTED when they do not fit) and gives them back when it is answered; a ScoreStream
    takes each request's bytes once it is read (waiting for bytes to be given back, `wait_freed`,
    when they do not fit) and gives them back when its handler is done, and does not read its next
    request while the budget (or its client's share) is full (`wait_room`), so under load the bytes
    stay with the client (HTTP/2 flow control) instead of being read and refused. A request alone is
    always admitted (the limit is at least the largest message gRPC accepts: settings), and so is a
    client's first while the total allows."""

    def __init__(self, limit: int, share_fraction: float = 1.0):
        self._bytes = PerClientLimit(limit, share_fraction)
        self.limit = limit
        self._room = asyncio.Event()
        self._room.set()
        self._waiters: list[asyncio.Future] = []  # wait_freed() callers

    @property
    def held(self) -> int:
        return self._bytes.held

    @property
    def peak(self) -> int:
        """The most ever held at once (tests, diagnostics)."""
        return self._bytes.peak

    @property
    def share(self) -> int:
        """What one client may hold."""
        return self._bytes.share

    def held_by(self, client: str | None) -> int:
        return self._bytes.held_by(client)

    @property
    def has_room(self) -> bool:
        return self.held < self.limit

    def has_room_for(self, client: str | None) -> bool:
        """Room in the total and in `client`'s share."""
        return self.has_room and (client is None or self.held_by(client) < self.share)

    def refusal(self, nbytes: int, client: str | None = None) -> str | None:
        """Why `nbytes` may not be taken now ("total", or "share": the client's), or None."""
        return self._bytes.refusal(nbytes, client)

    def try_take(self, nbytes: int, client: str | None = None) -> bool:
        """Admits `nbytes` (for `client`) if they fit (or nothing is held); False otherwise (nothing taken)."""
        if not self._bytes.try_take(nbytes, client):
            return False
        if not self.has_room:
            self._room.clear()
        return True

    def give(self, nbytes: int, client: str | None = None) -> None:
        self._bytes.give(nbytes, client)
        if self.has_room:
            self._room.set()
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def refused_message(self, nbytes: int, client: str | None = None, *, what: str = "this call", where: str = "") -> str:
        """The RESOURCE_EXHAUSTED message of `nbytes` of `what` refused for `client` (`refusal`)."""
        if self.refusal(nbytes, client) == "share":
            return (f"client {client} has {self.held_by(client)} request bytes in flight, {what} adds {nbytes}, "
                    f"its share {self.share} (max_inflight_request_bytes {self.limit} x max_client_share); retry later")
        return (f"{self.held} request bytes in flight{where}, {what} adds {nbytes}, "
                f"limit {self.limit} (max_inflight_request_bytes); retry later")

    async def wait_freed(self) -> None:
        """Returns the next time bytes are given back."""
        freed = asyncio.get_running_loop().create_future()
        self._waiters.append(freed)
        try:
            await freed
        finally:
            if freed in self._waiters:
                self._waiters.remove(freed)

    async def wait_room(self, client: str | None = None) -> None:
        """Returns once less than `limit` is held (and, with `client`, less than its share)."""
        while not self.has_room_for(client):
            await (self._room.wait() if not self.has_room else self.wait_freed())


class MemoryReturner:
    """Returns freed memory to the system after large messages."""

    def __init__(self) -> None:
        self._libc = libc()
        self._timer: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Future | None = None
        self._last_pass = float("-inf")
        self._last_large = self._first_pending = float("-inf")
        self.passes = 0
        self._watch: asyncio.Task | None = None
        self._rss_after_pass: int | None = None

    def start(self) -> None:
        """Pins large allocations to mmap and starts the RSS watch (once, on the serving loop)."""
        if self._libc is not None and not return_large_frees():
            log.warning("mallopt(M_MMAP_THRESHOLD) failed; large buffers may stay on the heap")
        if resident_bytes() is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_rss())

    async def _watch_rss(self) -> None:
        """Messages gRPC refuses itself (over the receive limit) never reach a handler: a pass when
        the resident memory has grown by WATCH_GROWTH_BYTES since the last pass (checked every
        WATCH_INTERVAL_S; the reference moves up after each pass, so memory really in use costs
        one pass per growth step, not one per check)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            rss = resident_bytes() or 0
            if self._rss_after_pass is None:
                self._rss_after_pass = rss
            elif rss - self._rss_after_pass > WATCH_GROWTH_BYTES and self._timer is None:
                self._return_memory(asyncio.get_running_loop())
                await asyncio.sleep(MIN_INTERVAL_S * 2)  # after the pass and its follow-up
                self._rss_after_pass = resident_bytes() or 0

    def message_done(self, nbytes: int) -> None:
        """A request message of `nbytes` is done with: a large one schedules a pass."""
        if nbytes < LARGE_MESSAGE_BYTES:
            return
        now = time.monotonic()
        self._last_large = now
        if self._timer is None:
            self._first_pending = now
            self._schedule(max(DELAY_S, self._last_pass + MIN_INTERVAL_S - now))

    def refused_unread(self) -> None:
        """A call was refused without reading its body: gRPC may have buffered part of it (up to its
        flow-control window), freed when the call ends: a pass after the burst returns it."""
        self.message_done(LARGE_MESSAGE_BYTES)

    def _schedule(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._due)

    def _due(self) -> None:
        """A pass once no large message has been done with for DELAY_S (the burst is over), or
        MIN_INTERVAL_S after the first pending one (a steady stream of them still gets passes)."""
        now = time.monotonic()
        if now - self._last_large < DELAY_S and now - self._first_pending < MIN_INTERVAL_S:
            self._schedule(self._last_large + DELAY_S - now)
            return
        self._return_memory(asyncio.get_running_loop())

    def _return_memory(self, loop: asyncio.AbstractEventLoop, *, follow_up: bool = True) -> None:
        """One pass; the first of a burst is followed by one more MIN_INTERVAL_S later, for what
        was still held by calls ending at the time (their gRPC buffers, a request being decoded)."""
        self._timer = None
        self._last_pass = time.monotonic()
        if follow_up:
            self._timer = loop.call_later(MIN_INTERVAL_S, functools.partial(self._return_memory, loop, follow_up=False))
        self.passes += 1
        collected = gc.collect()
        log.debug("memory pass %d: %d objects collected in %.3fs", self.passes, collected, time.monotonic() - self._last_pass)
        if self._libc is not None and (self._trimming is None or self._trimming.done()):
            self._trimming = loop.run_in_executor(None, self._libc.malloc_trim, 0)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
