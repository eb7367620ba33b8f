"""The teacher service's settings: CLI flags > `EOPD_TEACHER_*` env vars > YAML file > defaults.

`TeacherSettings` is the whole service's (network, security, admission, batching, the engine);
`EngineSettings`, from `TeacherSettings.engine_settings()`, is the part a scoring engine sees.

Device-aware defaults: `dtype`, `prefill_chunk_tokens` and `max_batch_tokens_per_client` default to
"auto", resolved at validation from the device the teacher will run on (`device_defaults`), so a
validated object always holds concrete values. On a CPU they are today's (float32 for parity with
other engines, 512-token chunked prefill and 4096-token client shares: a small request waits about
one 512-token step, issue 17). On CUDA: bfloat16, whole batches and a client share of a whole batch;
fairness between clients is kept between whole batches (a 16,384-token batch of a 1.5B teacher takes
~0.2 s on an H200, of an 8B one ~0.7 s), where chunking cut the server to 9-13% of its engine
(docs/teacher.md, "Device-aware defaults")."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from eopd_common.models import default_cache_dir
from .settings_base import ServiceSettings

MiB = 1024 * 1024
AUTO = "auto"
DEVICE_AWARE = ("dtype", "prefill_chunk_tokens", "max_batch_tokens_per_client")


def uses_cuda(device: str) -> bool:
    """Whether a `device` setting ('auto', 'cpu', 'cuda', 'cuda:N') runs on CUDA ('auto': if torch sees a GPU)."""
    if device == AUTO:
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def device_defaults(on_cuda: bool, max_batch_tokens: int) -> dict[str, object]:
    """The values of the device-aware settings left at "auto" (pure: the caller says which device)."""
    if on_cuda:
        return {"dtype": "bfloat16", "prefill_chunk_tokens": 0, "max_batch_tokens_per_client": max_batch_tokens}
    return {"dtype": "float32", "prefill_chunk_tokens": 512, "max_batch_tokens_per_client": 4096}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """A scoring engine's settings (a part of `TeacherSettings`, which documents each field): what to
    load and how to compute, nothing of the network, security or admission limits, which the server
    owns (`state.served_info`). `warmup_top_k` is the top-k of the warm-up batch scored at load."""

    model: str
    engine: str
    dtype: str
    device: str
    cache_dir: Path
    threads: int
    chunk_size: int
    prefill_chunk_tokens: int
    generate_step_ms: float
    compile_statistics: bool
    fp32_projection: bool
    share_prefill: bool
    warmup_top_k: int
    vllm_tensor_parallel_size: int
    vllm_gpu_memory_utilization: float
    vllm_kv_cache_gib: float | None
    vllm_max_model_len: int | None
    vllm_max_num_batched_tokens: int | None
    vllm_enforce_eager: bool

    def resolved_device(self) -> str:
        if self.device != AUTO:
            return self.device
        return "cuda" if uses_cuda(self.device) else "cpu"


class TeacherSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="EOPD_TEACHER_", frozen=True, extra="forbid", validate_default=True)

    # What to serve
    model: str = Field("smollm2-135m", description="preset (smollm2-135m, tiny-random[@SEED]), HF model directory or .gguf file")
    engine: Literal["transformers", "vllm"] = Field("transformers", description="scoring engine")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        AUTO, description="weights' dtype; statistics are always float32. auto: bfloat16 on CUDA, float32 on CPU "
        "(parity with other engines)")
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="where presets are materialised")
    threads: int = Field(0, ge=0, description="torch intra-op threads (0: torch's default)")

    # Network
    host: str = Field("127.0.0.1", description="address both servers bind to (0.0.0.0 in containers)")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port for /healthz, /readyz, /metrics (0: pick a free one)")
    ports_file: Path | None = Field(
        None,
        description='once both servers are bound, write {"grpc_port", "http_port", "pid", "probe_port"} here as JSON (atomically: a temp '
        "file, then a rename); for supervisors that start the teacher on port 0",
    )
    max_message_bytes: int = Field(64 * MiB, ge=MiB, description="gRPC max send/receive message size")
    # Bytes in flight and connections, bounded in total (docs/reliability.md, "Teacher memory and connections").
    max_request_bytes: int = Field(
        8 * MiB, ge=MiB,
        description="gRPC receive limit (the smaller of this and max_message_bytes applies): the largest request the "
        "per-request limits allow is ~6.9 MB (2^19 tokens of up to 5 bytes, 4096 ids of 256 four-byte characters)",
    )
    max_inflight_request_bytes: int = Field(
        512 * MiB, ge=MiB,
        description="request bytes (wire size) admitted and not yet answered, across every unary call and ScoreStream: "
        "beyond, a unary call gets RESOURCE_EXHAUSTED (retryable) and a stream request an in-band RESOURCE_EXHAUSTED "
        "(retryable), and streams stop reading until there is room; at least the receive limit (docs/reliability.md, "
        "\"Teacher memory and connections\", states the total bound)",
    )
    max_concurrent_calls: int = Field(
        64, ge=1,
        description="unary TeacherService calls served at once; beyond, RESOURCE_EXHAUSTED (retryable) before the "
        "request body is read",
    )
    max_client_share: float = Field(
        0.5, gt=0, le=1,
        description="the largest fraction of each global limit (max_concurrent_calls, max_streams, "
        "max_inflight_request_bytes, max_queue_tokens as tokens in flight, max_health_watches, "
        "http_max_concurrent_bodies) one client may hold: max(1, floor(limit x this)); beyond, RESOURCE_EXHAUSTED "
        "(retryable) naming the client's share, so one client cannot take all of a limit. A client is its peer address "
        "(IPv6: its /64; every loopback address is one client) and, when it authenticated, its identity there (the "
        "bearer token, or its certificate's name under mutual TLS); never x-eopd-client, which callers choose "
        "(docs/teacher.md, \"Per-client shares\"). 1: no shares",
    )
    request_receive_timeout_s: float = Field(
        30.0, gt=0,
        description="a unary call (Score, GetModelInfo, Generate) whose request message has not fully arrived this "
        "long after the call started ends with DEADLINE_EXCEEDED and frees its call slot (a client that never sends "
        "its body cannot hold a slot)",
    )
    max_health_watches: int = Field(
        256, ge=1,
        description="grpc.health.v1 Watch streams open at once (health needs no token; each costs a few KiB); beyond, "
        "and beyond one client's max_client_share of it, RESOURCE_EXHAUSTED (Check is not limited)",
    )
    stream_idle_timeout_s: float = Field(
        300.0, gt=0,
        description="a ScoreStream with no request in flight and none received for this long is ended with "
        "UNAVAILABLE (clients re-open it), and one whose client has not taken an answer for this long is cancelled, "
        "so idle streams and streams that never read cannot hold max_streams",
    )
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="HTTP side: close a connection whose request headers have not all arrived after this long"
    )
    http_max_connections: int = Field(
        4096, ge=1,
        description="HTTP side: open connections beyond which a new one is answered 503 and closed at once (also "
        "requests in progress, uvicorn's limit_concurrency); lowered to leave a quarter of the open-file limit "
        "(at least 384) to gRPC and the probes",
    )
    http_max_connections_per_peer: int = Field(
        256, ge=1,
        description="HTTP side: open connections from one client address beyond which a new one is answered 503 and "
        "closed at once, so one client cannot take http_max_connections",
    )
    http_body_timeout_s: float = Field(
        30.0, gt=0, description="HTTP side: close a connection whose request body has not all arrived this long after its headers"
    )
    http_max_concurrent_bodies: int = Field(
        64, ge=1,
        description="HTTP side: requests whose body is still arriving, at once (and one client's max_client_share of "
        "it); beyond, 429 before the body is read. A budget of its own beside max_concurrent_calls, which a request "
        "takes only once its body has arrived, so slow bodies cannot hold gRPC's call slots",
    )
    http_max_inflight_body_bytes: int = Field(
        128 * MiB, ge=MiB,
        description="HTTP side: request-body bytes held by requests in progress, in total; a request that does not fit "
        "beside them gets 503 (Retry-After: 1) before its body is read (a request alone is always admitted)",
    )
    http_probe_port: int | None = Field(
        None, ge=0, le=65535,
        description="a second HTTP listener serving only /healthz, /readyz and /metrics, with its own small connection "
        "budget, so a flood of the HTTP port cannot starve the orchestrator's probes (0: pick a free one; None: none, "
        "the probes are served on http_port only). They stay on http_port too",
    )
    max_concurrent_streams: int = Field(256, ge=1, description="HTTP/2 streams per connection")
    max_connection_age_s: float = Field(
        300.0, ge=0,
        description="close (GOAWAY) a client connection after this many seconds so clients re-resolve DNS and "
        "spread over replicas added since (0: never)",
    )
    max_connection_age_grace_s: float = Field(
        3600.0, ge=0, description="after max_connection_age_s, time the connection's open calls and streams get to finish"
    )
    load_failure_grace_s: float = Field(
        10.0, ge=0, description="after a failed model load, how long /readyz keeps answering 503 with the error before the process exits 1"
    )
    grace_seconds: float = Field(30.0, ge=0, description="on SIGTERM, time in-flight work gets to finish")

    # Security (see docs/reliability.md). Tokens and keys are read from files or env vars and never logged.
    auth_token: SecretStr | None = Field(
        None, description="bearer token every TeacherService call must carry (health is exempt); prefer auth_token_file or "
        "the env var EOPD_TEACHER_AUTH_TOKEN: as --auth-token it is in argv, readable by every local user",
    )
    auth_token_file: Path | None = Field(None, description="file holding the bearer token (alternative to auth_token)")
    create_token: bool = Field(
        False, description="with auth_token_file: if that file does not exist, create it (mode 0600) holding a new random "
        "token, which clients then read (--auth-token-file); an existing file is used as it is",
    )
    insecure_no_auth: bool = Field(
        False,
        description="serve without a bearer token or client certificates: anyone who reaches the ports may use the "
        "teacher, and shares key on addresses only (docs/teacher.md, \"Authentication\"). Without it, serve refuses "
        "to start unless auth_token(_file) or tls_client_ca_file is set. Env: EOPD_TEACHER_INSECURE_NO_AUTH=1",
    )
    tls_cert_file: Path | None = Field(None, description="PEM server certificate chain: serve gRPC over TLS")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    tls_client_ca_file: Path | None = Field(None, description="PEM CA bundle: require and verify client certificates (mutual TLS)")

    # Scoring
    default_top_k: int = Field(16, ge=1, description="top_k when a request says 0")
    max_top_k: int = Field(64, ge=1, description="largest top_k a request may ask for")
    max_candidates: int = Field(64, ge=0, description="largest Sequence.num_candidates (per-position candidate ids) a request may ask for; 0 serves none")
    chunk_size: int = Field(1024, ge=1, description="positions per output-projection chunk")
    compile_statistics: bool = Field(True, description="fuse the per-chunk statistics with torch.compile")
    fp32_projection: bool = Field(False, description="run the output projection in float32 for low-precision weights")
    share_prefill: bool = Field(
        True, description="transformers engine: the tokens a batch's sequences share before their scored positions (a "
        "common prefix such as a chat template, a prompt repeated for several samples) run once "
        "(`eopd_common.shared_prefill`); the same numbers to float rounding")

    # Generation (the Generate RPC; served only by engines that can generate)
    max_new_tokens: int = Field(1024, ge=1, description="largest GenerateRequest.max_new_tokens")
    max_generate_samples: int = Field(16, ge=1, description="largest GenerateRequest.num_samples (responses per prompt)")
    generate_step_ms: float = Field(
        50.0, ge=0,
        description="transformers engine: decode time per engine turn of a Generate job (its prompts and samples decoded "
        "as one batch); other clients' scoring batches are served between turns, the KV cache kept. 0: a job decodes "
        "to the end in one turn",
    )

    # Batching and admission
    max_batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch")
    prefill_chunk_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        AUTO,
        description="transformers engine: padded tokens per engine step (chunked prefill, the KV cache carried between "
        "steps); the batcher serves other clients' batches between the steps of a longer batch, so a small request "
        "waits for about one step, not one batch. 0: whole batches (the vLLM engine always scores whole batches). "
        "auto: 512 on CPU, 0 on CUDA",
    )
    max_batch_wait_ms: float = Field(5.0, ge=0, description="longest wait to fill a batch")
    max_batch_tokens_per_client: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        AUTO,
        description="one client's share of one forward batch, in tokens (fair queuing: a larger request is served over "
        "several batches, other clients' requests between them; at least one sequence per batch; "
        "= max_batch_tokens turns the split off). auto: 4096 on CPU, max_batch_tokens on CUDA",
    )
    max_queue_tokens: int = Field(1 << 20, ge=1, description="queued tokens beyond which requests get RESOURCE_EXHAUSTED")
    max_sequences_per_request: int = Field(4096, ge=1, description="sequences per request")
    max_tokens_per_request: int = Field(1 << 19, ge=1, description="tokens per request (all sequences)")
    max_streams: int = Field(
        256, ge=1,
        description="concurrent ScoreStream calls (RESOURCE_EXHAUSTED beyond); each may be receiving one message of up to "
        "the receive limit outside max_inflight_request_bytes, so this times max_request_bytes is part of the memory bound",
    )
    max_inflight_tokens_per_client: int = Field(
        1 << 19, ge=1, description="tokens one client (x-eopd-client metadata, else peer address) may have in flight"
    )

    # vLLM engine (engine=vllm; `dtype` and `threads` above apply too). See docs/vllm.md.
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs the teacher is sharded over (tensor parallelism)")
    vllm_gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1,
        description="vLLM on GPU: fraction of GPU memory vLLM may take for weights, activations and KV cache "
        "(leave room for the output projection the engine keeps beside it)",
    )
    vllm_kv_cache_gib: float | None = Field(
        None, gt=0,
        description="vLLM: KV cache size in GiB; overrides vllm_gpu_memory_utilization on GPU. "
        "None: sized from the memory utilisation on GPU, 1 GiB on CPU",
    )
    vllm_max_model_len: int | None = Field(None, ge=2, description="vLLM: longest sequence (None: the model's context length)")
    vllm_max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="vLLM: tokens per forward step (None: vLLM's default; at least the max model length, "
        "since a sequence is never split across steps)",
    )
    vllm_enforce_eager: bool = Field(True, description="vLLM: no CUDA graphs / torch.compile (fast start; scoring is prefill only)")

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")

    @model_validator(mode="before")
    @classmethod
    def _device_aware(cls, data: object) -> object:
        """Fills the device-aware settings left unset or "auto" (`device_defaults`)."""
        if not isinstance(data, dict):
            return data
        unset = [name for name in DEVICE_AWARE if data.get(name) in (None, "", AUTO)]
        if not unset:
            return data
        device = str(data.get("device") or AUTO)
        if not (device == AUTO or device == "cpu" or device.startswith("cuda")):
            return data  # the after-validator names the bad device
        try:
            max_batch_tokens = int(data.get("max_batch_tokens") or cls.model_fields["max_batch_tokens"].default)
        except (TypeError, ValueError):
            return data  # the field's own validation names it
        defaults = device_defaults(uses_cuda(device), max_batch_tokens)
        return {**data, **{name: defaults[name] for name in unset}}

    @model_validator(mode="after")
    def _check(self) -> "TeacherSettings":
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device {self.device!r} must be auto, cpu, cuda or cuda:N")
        for name in DEVICE_AWARE:
            if getattr(self, name) == AUTO:
                raise ValueError(f"{name}: auto could not be resolved (see device)")
        if self.default_top_k > self.max_top_k:
            raise ValueError(f"default_top_k ({self.default_top_k}) must be <= max_top_k ({self.max_top_k})")
        receive_limit = min(self.max_request_bytes, self.max_message_bytes)
        if self.max_inflight_request_bytes < receive_limit:
            raise ValueError(f"max_inflight_request_bytes ({self.max_inflight_request_bytes}) must be >= the receive limit "
                             f"min(max_request_bytes, max_message_bytes) ({receive_limit}), or a largest request could never be admitted")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError("give auth_token or auth_token_file, not both")
        if self.create_token and self.auth_token_file is None:
            raise ValueError("create_token: needs auth_token_file, the file to create the token in")
        creating = self.create_token and not Path(self.auth_token_file).exists()
        for name in ("auth_token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file() and not (name == "auth_token_file" and creating):
                raise ValueError(f"{name}: {path} is not a readable file")
        if self.auth_token_file is not None and not creating and not self.bearer_token():  # fail closed, never "no auth"
            raise ValueError(f"auth_token_file: {self.auth_token_file} is empty (an empty token would turn auth off)")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("auth_token: empty (an empty token would turn auth off)")
        return self

    def client_auth(self) -> str | None:
        """How callers authenticate: "token" (a bearer token; with mutual TLS too), "mtls" (client
        certificates only), or None (nobody: allowed only with insecure_no_auth, `auth_refusal`)."""
        if self.auth_token is not None or self.auth_token_file is not None:
            return "token"
        return "mtls" if self.tls_client_ca_file is not None else None

    def auth_refusal(self) -> str | None:
        """Why these settings may not serve (no client authentication and no explicit opt-out), or None."""
        if self.client_auth() is not None or self.insecure_no_auth:
            return None
        return ("no client authentication: give a bearer token (--auth-token-file FILE, with --create-token to create "
                "the file; or EOPD_TEACHER_AUTH_TOKEN / EOPD_TEACHER_AUTH_TOKEN_FILE) or client certificates "
                "(--tls-client-ca-file with --tls-cert-file/--tls-key-file), or serve anyone who reaches the ports "
                "with --insecure-no-auth (EOPD_TEACHER_INSECURE_NO_AUTH=1)")

    def bearer_token(self) -> str | None:
        """The configured token (from auth_token or auth_token_file), or None."""
        if self.auth_token is not None:
            return self.auth_token.get_secret_value()
        if self.auth_token_file is not None:
            return Path(self.auth_token_file).read_text().strip()
        return None

    def engine_settings(self) -> EngineSettings:
        """What the scoring engine needs: the model, its dtype and device, the statistics and the vLLM
        settings (the engine warms up at `default_top_k`)."""
        names = [f.name for f in dataclasses.fields(EngineSettings) if f.name != "warmup_top_k"]
        return EngineSettings(**{name: getattr(self, name) for name in names}, warmup_top_k=self.default_top_k)

