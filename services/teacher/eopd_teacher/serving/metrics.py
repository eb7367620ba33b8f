"""Prometheus metrics of the teacher (one registry per server instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class TeacherMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("eopd_teacher_requests", "RPCs answered, by method and status code", ["method", "code"], registry=r)
        self.errors = Counter("eopd_teacher_errors", "RPCs that ended with an error, by status code", ["code"], registry=r)
        self.latency = Histogram(
            "eopd_teacher_request_latency_seconds", "RPC latency (streams: per ScoreRequest)", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.stream_requests = Counter(
            "eopd_teacher_stream_requests", "ScoreStream requests answered, by code (OK, or an in-band error's code)", ["code"], registry=r
        )
        self.sequences = Counter("eopd_teacher_sequences_scored", "sequences scored", registry=r)
        self.tokens_scored = Counter("eopd_teacher_tokens_scored", "positions scored (response tokens)", registry=r)
        self.generations = Counter("eopd_teacher_generations", "responses generated (Generate; one per prompt and sample)", registry=r)
        self.tokens_generated = Counter("eopd_teacher_tokens_generated", "tokens generated (Generate)", registry=r)
        self.tokens_forward = Counter("eopd_teacher_tokens_forward", "tokens run through the model (prompt + response)", registry=r)
        self.batch_sequences = Histogram(
            "eopd_teacher_batch_sequences", "sequences per forward batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r
        )
        self.batch_tokens = Histogram(
            "eopd_teacher_batch_tokens", "padded tokens per forward batch", buckets=tuple(2**i for i in range(6, 19)), registry=r
        )
        self.batch_padding = Histogram(
            "eopd_teacher_batch_padding_ratio", "padding share of a forward batch", buckets=(0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1), registry=r
        )
        self.batch_latency = Histogram("eopd_teacher_batch_latency_seconds", "engine time per batch", buckets=_LATENCY_BUCKETS, registry=r)
        # Where a request's time goes besides the engine call (batch_latency): the wait in the queue,
        # the wait for the statistics' copy to the host, splitting them per sequence, protobuf encoding.
        fine = (0.0001, 0.00025, 0.0005, 0.001, 0.0025) + _LATENCY_BUCKETS
        self.queue_wait = Histogram("eopd_teacher_queue_wait_seconds", "a batch's oldest sequence's wait in the queue before its batch started",
                                    buckets=fine, registry=r)
        self.copy_wait = Histogram("eopd_teacher_copy_wait_seconds", "per batch: waiting for the statistics' copy from the device "
                                   "(after the engine call returned; 0 on the CPU)", buckets=fine, registry=r)
        self.split = Histogram("eopd_teacher_split_seconds", "per batch: splitting the statistics per sequence", buckets=fine, registry=r)
        self.encode = Histogram("eopd_teacher_encode_seconds", "per Score request: encoding the answer (protobuf)", buckets=fine, registry=r)
        self.queue_sequences = Gauge("eopd_teacher_queue_sequences", "sequences waiting for a batch", registry=r)
        self.queue_tokens = Gauge("eopd_teacher_queue_tokens", "tokens waiting for a batch", registry=r)
        self.inflight = Gauge("eopd_teacher_inflight_requests", "ScoreRequests and GenerateRequests being served", registry=r)
        self.statistics_compiled = Gauge(
            "eopd_teacher_statistics_compiled",
            "1 when the statistics run under torch.compile, 0 on the eager path (compile_statistics off, or compiling failed)",
            registry=r,
        )
        self.ready = Gauge("eopd_teacher_ready", "1 when the model is loaded and requests are accepted", registry=r)
        # What the global limits hold now (set_function by ServerState; each also split by client: serving/shares.py).
        self.calls_in_progress = Gauge("eopd_teacher_calls_in_progress", "unary calls and Generates being served (max_concurrent_calls)", registry=r)
        self.open_streams = Gauge("eopd_teacher_open_streams", "ScoreStreams open (max_streams)", registry=r)
        self.streams_stalled = Counter(
            "eopd_teacher_streams_stalled", "ScoreStreams given up because their client took no answer for stream_idle_timeout_s",
            registry=r)
        self.health_watches = Gauge("eopd_teacher_health_watches", "grpc.health.v1 Watch streams open (max_health_watches)", registry=r)

    def on_batch(self, sequences: int, tokens: int, padded: int, seconds: float) -> None:
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(padded)
        self.batch_padding.observe(1 - tokens / padded if padded else 0)
        self.batch_latency.observe(seconds)
        self.tokens_forward.inc(tokens)

    def on_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def on_delivery(self, copy_wait_s: float, split_s: float) -> None:
        self.copy_wait.observe(copy_wait_s)
        self.split.observe(split_s)

    def on_queue(self, sequences: int, tokens: int) -> None:
        self.queue_sequences.set(sequences)
        self.queue_tokens.set(tokens)
