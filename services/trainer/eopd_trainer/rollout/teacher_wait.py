"""Waiting for the teacher before the worker takes any task (`wait_for_teacher`): its ModelInfo,
asked once per round until `teacher.ready_timeout_s`; a teacher that refuses the worker's
credentials (`TeacherRefused`) or a stop signal (`StopRequested`) ends the wait at once."""

from __future__ import annotations

import asyncio
import time

from ..config import TeacherConfig


class StopRequested(Exception):
    """A signal arrived before the worker started working."""


class TeacherRefused(RuntimeError):
    """The teacher rejected the worker's credentials: retrying cannot help."""


async def wait_for_teacher(client, teacher: TeacherConfig, stop: asyncio.Event):
    """The teacher's ModelInfo, once it answers. Raises TeacherRefused (UNAUTHENTICATED,
    PERMISSION_DENIED), RuntimeError after teacher.ready_timeout_s, StopRequested when `stop` is set."""
    deadline = time.monotonic() + teacher.ready_timeout_s
    while True:
        try:
            # One attempt per round (the client's own retry budget would outlast ready_timeout_s
            # and this loop's checks of the deadline and of a stop signal).
            return await client.info(timeout=max(1.0, min(10.0, deadline - time.monotonic())), retry_timeout=0)
        except Exception as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            if code is not None and code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
                raise TeacherRefused(
                    f"the teacher at {teacher.target} refused this worker ({code.name}: {exc.details()}); "
                    "check teacher.auth_token_file / EOPD_TEACHER_AUTH_TOKEN and the teacher.tls_* settings") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"teacher at {teacher.target} not reachable: {exc}") from exc
            if stop.is_set():
                raise StopRequested from None
            await asyncio.sleep(0.5)
