"""The concurrent-call limit shared by both front ends: unary TeacherService calls (gRPC's
`StatusInterceptor`) and `POST /v1/completions` (`http/admission.py`) count against the same
`max_concurrent_calls`, so a caller cannot go around the gRPC limit through the HTTP side
(issue 33, section 1)."""

from __future__ import annotations


class CallSlots:
    """Calls in progress (`count`), at most `limit` at once (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.count = 0

    def try_take(self) -> bool:
        """Takes a slot if one is free; False otherwise (nothing taken)."""
        if self.limit is not None and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def give(self) -> None:
        self.count -= 1
