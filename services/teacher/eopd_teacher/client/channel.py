"""What the sync and asyncio clients share: the channel's options and credentials, the metadata
every call carries, which statuses are retried, and the backoff (`Backoff`) and deadline
(`CallPlan`) of the retries. Token and TLS settings become credentials, options and metadata in
one place: `eopd_common.client_security.ClientSecurity`."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from eopd_common.client_security import ClientSecurity

from ..convert import NOT_RETRYABLE_KEY

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# What grpcio's asyncio client reports, in place of the server's status, when one of its writes
# races the end of a stream (grpc/grpc#36066): the real status is lost. Our server announces the end
# of a stream first (StreamEnding), so this is left for a stream cut without warning (the teacher
# died mid-write): treated like UNAVAILABLE, i.e. the unanswered requests are re-sent, and a
# request that really fails is then reported with its own status.
LOST_STATUS_DETAILS = "Internal error from Core"


def channel_options(target: str, max_message_bytes: int, load_balancing: str | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Each channel owns its connections. With grpc's process-wide subchannel pool the channel
        # that replaces a stalled one (`AsyncTeacherClient._reconnect`, after a stream went silent)
        # could silently reuse the dead TCP connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    policy = load_balancing or ("round_robin" if target.startswith("dns:") else None)
    if policy:
        opts.append(("grpc.lb_policy_name", policy))
    return opts


class Backoff:
    def __init__(self, retry_timeout: float, initial: float = 0.1, maximum: float = 5.0):
        self.deadline = time.monotonic() + retry_timeout
        self.delay = initial
        self.maximum = maximum

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None when the retry budget is spent."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        delay = min(self.delay * random.uniform(0.5, 1.5), remaining)
        self.delay = min(self.delay * 2, self.maximum)
        return delay


class CallPlan:
    """The deadline of one unary call across its retries. `timeout` (None: the client's `timeout`;
    0 is a real, already-passed deadline, not "the default") is an overall deadline: each attempt
    gets the time that remains, and no retry is started or waited for beyond it. Retries stop
    once `retry_timeout` (None: the client's) has passed too, so a call takes at most
    `timeout` and retries for at most min(`timeout`, `retry_timeout`)."""

    def __init__(self, client: ChannelClient, timeout: float | None, retry_timeout: float | None):
        self.client = client
        total = client.timeout if timeout is None else timeout
        budget = client.retry_timeout if retry_timeout is None else retry_timeout
        if total is not None:
            budget = min(budget, total)
        self.deadline = None if total is None else time.monotonic() + total
        self.backoff = Backoff(budget)

    def attempt_timeout(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def retry_delay(self, err: grpc.RpcError) -> float | None:
        """Seconds to wait before retrying after `err`, or None to raise it."""
        if not self.client.should_retry(err):
            return None
        delay = self.backoff.next_delay()
        if delay is None or (self.deadline is not None and time.monotonic() + delay >= self.deadline):
            return None
        return delay


@dataclass(frozen=True)
class StreamTransport:
    """What a client's ScoreStream machinery (`stream.py`, `sync_stream.py`) gets from its client,
    handed in rather than reached for: where calls go and with what metadata, the deadlines and the
    retry policy, `open_stream` (a ScoreStream call on the client's current channel) and, for the
    asyncio client, `reconnect` (a new channel, after a stall)."""

    target: str
    metadata: tuple[tuple[str, str], ...]
    timeout: float | None
    retry_timeout: float
    retryable: tuple[grpc.StatusCode, ...]
    open_stream: Callable[..., object]
    should_retry: Callable[[grpc.RpcError], bool]
    reconnect: Callable[[], Awaitable[None]] | None = None


class ChannelClient:
    """The settings of a client's channel and calls (the base of TeacherClient and
    AsyncTeacherClient, which open the channel).

    Security: `security=ClientSecurity(...)` (e.g. `ClientSecurity.from_files(...)`, or a run
    configuration's `teacher.client_security()`), or the same settings as the keywords `auth_token`,
    `tls`, `tls_ca_file`, `tls_cert_file`, `tls_key_file` and `tls_server_name`, not both. An explicit
    `credentials` replaces the TLS credentials they would make."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 300.0,
        retry_timeout: float = 60.0,
        retry_overload: bool = True,
        load_balancing: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        security: ClientSecurity | None = None,
        auth_token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls: bool = False,
        tls_server_name: str | None = None,
        client_id: str | None = None,
    ):
        self.target = target
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.retryable = RETRYABLE + ((grpc.StatusCode.RESOURCE_EXHAUSTED,) if retry_overload else ())
        keywords = {"auth_token": auth_token, "tls": tls, "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
                    "tls_key_file": tls_key_file, "tls_server_name": tls_server_name}
        if security is None:
            security = ClientSecurity(auth_token=auth_token or None, tls=tls,
                                      **{k: str(v) if v else None for k, v in keywords.items() if k.startswith("tls_")})
        elif any(keywords.values()):
            given = ", ".join(k for k, v in keywords.items() if v)
            raise TypeError(f"give security= or the keywords {given}, not both")
        self.security = security
        client = ("x-eopd-client", client_id or f"{socket.gethostname()}-{os.getpid()}")
        self.metadata = tuple(metadata) + (client,) + security.metadata()
        self._options = channel_options(target, max_message_bytes, load_balancing) + security.channel_options()
        self._credentials = credentials if credentials is not None else security.channel_credentials()

    def should_retry(self, err: grpc.RpcError) -> bool:
        """Whether a call that failed with `err` is worth another attempt."""
        code = err.code()
        if code == grpc.StatusCode.INTERNAL and err.details() == LOST_STATUS_DETAILS:
            return True
        if code not in self.retryable:
            return False
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Over a per-request limit (the server says so), or over gRPC's message-size limit (its
            # own status, sent before or after our handlers run): the same request fails again.
            if any(k == NOT_RETRYABLE_KEY and v == "0" for k, v in (err.trailing_metadata() or ())):
                return False
            if "larger than max" in (err.details() or ""):
                return False
        return True
