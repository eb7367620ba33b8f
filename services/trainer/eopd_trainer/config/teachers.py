"""The teachers of a run: `teacher:` (the teacher named `teacher`, the default route: every run has
it), `teachers:` (more teachers by name, each a full teacher section) and `route:` (which teacher
scores, and generates for, a prompt: a rule on a field of its data record). Issue 32."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from eopd_common.client_security import ClientSecurity, SecurityFileError

from ..teacher_context import template_fields
from .base import ConfigError, Section

DEFAULT_TEACHER = "teacher"  # the name of the `teacher:` section's teacher
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class TeacherConfig(Section):
    target: str = Field("127.0.0.1:50051", description="gRPC target of the teacher service (host:port or dns:///name:port).")
    top_k: int = Field(16, ge=1, le=1024, description="Teacher top-k returned per position (paper: 16).")
    temperature: float = Field(1.0, gt=0, description="Teacher temperature applied before every statistic.")
    sequences_per_request: int = Field(4, ge=1, description="Sequences per ScoreStream request.")
    max_in_flight: int = Field(8, ge=1, description="Unanswered requests on the stream (pipelining depth).")
    timeout_s: float = Field(300.0, gt=0, description="Deadline of one teacher call; on the worker's stream: requests outstanding "
                             "and no answer for this long -> the stream is abandoned, the channel replaced, the requests re-sent.")
    retry_timeout_s: float = Field(300.0, gt=0, description="How long UNAVAILABLE (teacher restarting) is retried before the worker gives up.")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long the worker waits for the teacher at start.")
    streams: int = Field(2, ge=1, description="ScoreStreams a worker keeps open to the teacher (its requests spread over them); "
                         "with a dns:/// target and round_robin load balancing they land on different teacher replicas.")
    token_remap: dict[int, int] = Field(
        default_factory=dict,
        description="Student token id -> teacher token id applied to the response tokens sent to the teacher (e.g. the "
        "student's end-of-text id to the teacher's end-of-turn id; the prompt is sent as rendered); the teacher's "
        "top-k ids are mapped back. Must be invertible: no two ids mapped to the same target.",
    )
    hidden_states: Literal["none", "bfloat16", "float32"] = Field(
        "none", description="Also ask the teacher for its final hidden states at every response position (ScoreRequest."
        "hidden_states) and carry them in each rollout, for losses over the teacher's full vocabulary (the learner "
        "projects them with the teacher's output head, GetOutputHead). none: top-k only (the default, except "
        "that a loss with loss.support full gets bfloat16 when this is left unset; see docs/teacher.md for the "
        "bytes per token of each mode).")
    check_tokenizer: bool = Field(True, description="Refuse to run when the teacher's tokenizer fingerprint differs from the student's "
                                                  "(a difference of special tokens explained by token_remap is accepted).")
    model: str = Field("", description="Model spec `eopd run` serves as the teacher (and `eopd eval` compares against); "
                       "ignored by the learner and the workers, which use `target`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype of the teacher `eopd run` starts (its --dtype); auto: bfloat16 on CUDA, float32 "
        "on CPU (the teacher's device-aware default). Statistics are float32 either way.")
    auth_token_file: str = Field("", description="File holding the bearer token the workers send to the teacher (`authorization: "
                                 "Bearer ...`); when empty, the env var EOPD_TEACHER_AUTH_TOKEN is used if set. The token "
                                 "itself is never part of the config (which is written into the run directory).")
    tls: bool = Field(False, description="Connect over TLS (implied by tls_ca_file or tls_cert_file); without tls_ca_file "
                      "the system's root certificates are trusted.")
    tls_ca_file: str = Field("", description="CA bundle that signed the teacher's certificate (turns TLS on).")
    tls_cert_file: str = Field("", description="Client certificate for mutual TLS (with tls_key_file).")
    tls_key_file: str = Field("", description="Client private key for mutual TLS (with tls_cert_file).")
    tls_server_name: str = Field("", description="Name to verify the teacher's certificate against when it differs from "
                                 "the target's host (e.g. the target is an IP address).")
    prompt_template: str = Field("", description="Privileged teacher context: the user message the teacher is shown instead of "
                                 "the student's prompt, filled from the data record ({prompt}: the student's prompt text; "
                                 "{answer}, {solution}, any {field}: the record's field). The teacher scores (and, for KD/GKD, "
                                 "generates) the student's response after it; the student never sees it. Empty: the teacher "
                                 "sees the student's prompt.")

    @model_validator(mode="after")
    def _invertible_remap(self) -> TeacherConfig:
        negative = sorted(i for pair in self.token_remap.items() for i in pair if i < 0)
        if negative:
            raise ValueError(f"teacher.token_remap: token ids must be >= 0, got {negative}")
        sources: dict[int, list[int]] = {}
        for src, dst in self.token_remap.items():
            sources.setdefault(dst, []).append(src)
        shared = {dst: srcs for dst, srcs in sources.items() if len(srcs) > 1}
        if shared:
            dst, srcs = min(shared.items())
            raise ValueError(f"teacher.token_remap: ids {sorted(srcs)} are all mapped to {dst}: the remap must be invertible "
                             "(the teacher's top-k ids are mapped back to student ids)")
        return self

    @model_validator(mode="after")
    def _template_parses(self) -> TeacherConfig:
        if self.prompt_template:
            try:
                template_fields(self.prompt_template)
            except ValueError as exc:
                raise ValueError(f"teacher.prompt_template: {exc}") from None
        return self

    @model_validator(mode="after")
    def _mutual_tls_pair(self) -> TeacherConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = ("tls_cert_file", "tls_key_file") if self.tls_cert_file else ("tls_key_file", "tls_cert_file")
            raise ValueError(f"teacher.{given} is set but teacher.{missing} is not: mutual TLS needs both")
        return self

    def client_security(self) -> ClientSecurity:
        """The token and TLS settings of eopd_teacher's clients (`security=`): reads the token and
        certificate files now, so a missing or unreadable one, or an empty token file, fails at start
        with a ConfigError naming the field."""
        try:
            return ClientSecurity.from_files(auth_token_file=self.auth_token_file, tls=self.tls, tls_ca_file=self.tls_ca_file,
                                             tls_cert_file=self.tls_cert_file, tls_key_file=self.tls_key_file,
                                             tls_server_name=self.tls_server_name, field_prefix="teacher.")
        except SecurityFileError as exc:
            raise ConfigError(str(exc)) from None


class NamedTeacher(TeacherConfig):
    """One of `teachers:`: a teacher section with a name (lower case, digits, _ or -; not `teacher`)."""

    name: str = Field(..., description="The teacher's name, used by `route:`, in its process's log and in the metrics.")

    @model_validator(mode="after")
    def _name_ok(self) -> NamedTeacher:
        if not _NAME.match(self.name):
            raise ValueError(f"teachers: name {self.name!r} must be 1-32 of a-z, 0-9, _ or -, starting with a letter")
        if self.name == DEFAULT_TEACHER:
            raise ValueError(f"teachers: the name {DEFAULT_TEACHER!r} is the `teacher:` section's; pick another")
        return self


class RouteConfig(Section):
    """Which teacher a prompt goes to: `routes[record[field]]`, else `default`."""

    field: str = Field("", description="The data record's field routed on (e.g. kind); empty: every prompt to `default`.")
    routes: dict[str, str] = Field(default_factory=dict, description="Field value -> teacher name.")
    default: str = Field(DEFAULT_TEACHER, description="The teacher of a prompt no route names (`teacher`: the teacher: section's).")
    mixture: dict[str, float] = Field(default_factory=dict, description="Instead of routes: every response is scored by each "
                                      "of these teachers and the loss is the weighted sum of their losses (weights > 0, "
                                      "summing to 1; the first teacher named is the rollout's main one).")

    def teacher_names(self) -> list[str]:
        """The teachers the rollout workers ask: the mixture's, or every one a route reaches (the default first)."""
        if self.mixture:
            return list(self.mixture)
        return list(dict.fromkeys([self.default, *self.routes.values()]))

    def teacher_of(self, record: dict) -> str:
        value = record.get(self.field) if self.field else None
        return self.routes.get(str(value), self.default) if value is not None else self.default

    def asks(self, name: str, record: dict) -> bool:
        """Whether teacher `name` is asked for `record`'s prompt: every teacher of the mixture is,
        else the one its route names."""
        return name in self.mixture if self.mixture else self.teacher_of(record) == name


def teacher_key(name: str) -> str:
    """The config key of teacher `name`'s section, for messages: `teacher` or `teachers[NAME]`."""
    return DEFAULT_TEACHER if name == DEFAULT_TEACHER else f"teachers[{name}]"


def check_routes(teacher: TeacherConfig, teachers: list[NamedTeacher], route: RouteConfig, *,
                 teacher_generates: bool = False) -> None:
    """ValueError naming the key: duplicate names, a route to an unknown teacher, routes without a
    field, a teacher no route reaches (it would be started and never asked), a mixture's unknown
    teachers or weights (> 0, summing to 1), a mixture beside routes or where a teacher generates
    responses (`teacher_generates`: kd, gkd, a KD warm-up)."""
    names = [DEFAULT_TEACHER] + [t.name for t in teachers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"teachers: names must be unique; {dup} given more than once")
    if route.mixture:
        _check_mixture(route, names, teacher_generates)
        return
    if route.routes and not route.field:
        raise ValueError("route.routes is set but route.field is empty: name the data record's field routed on")
    for where, name in [("route.default", route.default)] + [(f"route.routes[{v!r}]", n) for v, n in route.routes.items()]:
        if name not in names:
            raise ValueError(f"{where}: unknown teacher {name!r}; the teachers are {names}")
    used = {route.default, *route.routes.values()}
    unused = [n for n in names[1:] if n not in used]
    if unused:
        raise ValueError(f"teachers: {unused} reached by no route (route.routes / route.default): they would never be asked")


def _check_mixture(route: RouteConfig, names: list[str], teacher_generates: bool) -> None:
    mix = route.mixture
    unknown = [n for n in mix if n not in names]
    if unknown:
        raise ValueError(f"route.mixture: unknown teachers {unknown}; the teachers are {names}")
    if len(mix) < 2:
        raise ValueError("route.mixture: name at least two teachers (one teacher is route.default)")
    bad = {n: w for n, w in mix.items() if not w > 0}
    if bad:
        raise ValueError(f"route.mixture: weights must be > 0, got {bad}")
    total = sum(mix.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"route.mixture: weights must sum to 1, they sum to {total:g} ({mix})")
    if route.routes or route.field:
        raise ValueError("route.mixture and route.routes / route.field: a run either routes each prompt to one teacher "
                         "or scores every response with the mixture")
    unused = [n for n in names[1:] if n not in mix]
    if unused:
        raise ValueError(f"teachers: {unused} not in route.mixture: they would never be asked")
    if teacher_generates:
        raise ValueError("route.mixture: not with a teacher generating responses (loss.variant kd / gkd, "
                         "train.warmup_kd_iterations): a generated response would be scored by one teacher only")
