"""Python clients of the teacher (sync and asyncio). Protobuf stays inside: callers pass token ids
and get numpy arrays back (`token_logprobs [n]`, `entropies [n]`, `topk_ids [n, k]`,
`topk_logprobs [n, k]`); `generate` returns `Generation`s (the sampled ids and those statistics).

Targets are gRPC target strings: `host:port`, or `dns:///teacher-headless:50051` to balance over
every replica behind a headless Kubernetes Service (`load_balancing="round_robin"`, the default
for `dns:///` targets).

Security: `auth_token=` sends `authorization: Bearer <token>`; `tls_ca_file=` (server CA) turns on
TLS (`tls=True` alone trusts the system's roots; `tls_server_name=` overrides the name checked against
the server's certificate), and `tls_cert_file=`/`tls_key_file=` add a client certificate for mutual TLS. Every call
carries `x-eopd-client` (`client_id=`, default host-pid), the key of the server's per-client limits.

Retries: calls that fail with UNAVAILABLE (server restarting, draining or unreachable) or, when
`retry_overload` is set, RESOURCE_EXHAUSTED, are retried with exponential backoff and jitter until
`retry_timeout` seconds have passed; except a RESOURCE_EXHAUSTED that retrying cannot cure (the
request is over a per-request limit: trailing metadata `eopd-retryable: 0`, or over gRPC's message
size), which fails at once. `AsyncTeacherClient.score_stream` re-sends on a new stream
the requests that a broken stream left unanswered, so a producer loses nothing when a replica dies;
with `stall_timeout_s` it also reconnects and re-sends when the teacher goes silent (`StallReport`,
`StreamStalled`).

The package's modules: `requests` (what is sent, `RequestFailed`), `channel` (options, credentials,
retry policy), `unary` (the two clients), `stream` (their ScoreStream machinery). This module is
the public API and re-exports their public names.
"""

from .requests import RequestFailed, ScoreBatch, SequenceInput, build_generate_request, build_request
from .stream import StallReport, StreamStalled
from .unary import AsyncTeacherClient, TeacherClient

__all__ = [
    "AsyncTeacherClient",
    "RequestFailed",
    "ScoreBatch",
    "SequenceInput",
    "StallReport",
    "StreamStalled",
    "TeacherClient",
    "build_generate_request",
    "build_request",
]
