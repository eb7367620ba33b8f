"""How a client of the teacher authenticates and encrypts: one value for the teacher's clients, the
`eopd-teacher` command line and the rollout workers' run configuration.

`ClientSecurity(auth_token=..., tls=..., tls_ca_file=..., tls_cert_file=..., tls_key_file=...,
tls_server_name=...)` holds the settings as the clients' keywords take them. `from_files` builds
one from settings that name files (a run configuration, command-line flags): it reads the token
file (else the `EOPD_TEACHER_AUTH_TOKEN` variable), refuses an empty token file, and checks now that
the TLS files are readable, so a bad file fails at start, with a `SecurityFileError` naming the
setting, rather than at the first call. `metadata()`, `channel_credentials()` and
`channel_options()` are what a gRPC channel and its calls need.

TLS is on with `tls=True`, or when a CA bundle or a client certificate is given; without a CA bundle
the system's root certificates are trusted. `tls_server_name` is the name checked against the
server's certificate when it differs from the target's host.

The token is never part of `repr()`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import grpc

TOKEN_ENV = "EOPD_TEACHER_AUTH_TOKEN"
_TLS_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")


class SecurityFileError(ValueError):
    """A token or TLS file that cannot be used: `field` is the setting's name as the caller spells
    it (e.g. `teacher.tls_ca_file` or `--tls-ca-file`), `path` the file."""

    def __init__(self, field: str, path: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.path = path


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.tls_ca_file or self.tls_cert_file)

    @classmethod
    def from_files(
        cls,
        *,
        auth_token_file: str | os.PathLike | None = None,
        tls: bool = False,
        tls_ca_file: str | os.PathLike | None = None,
        tls_cert_file: str | os.PathLike | None = None,
        tls_key_file: str | os.PathLike | None = None,
        tls_server_name: str | None = None,
        environ: Mapping[str, str] | None = None,
        field_prefix: str = "",
    ) -> ClientSecurity:
        """The settings of a configuration that names files (an empty string counts as unset).

        The token is the stripped content of `auth_token_file`, else `EOPD_TEACHER_AUTH_TOKEN` from
        `environ` (default: `os.environ`; blank counts as unset). With TLS on, the TLS files given
        must be readable now, and `tls` is set; with TLS off the TLS settings are dropped.
        `field_prefix` goes before each setting's name in messages: `"teacher."` names
        `teacher.tls_ca_file`, `"--"` the flag `--tls-ca-file`. Raises `SecurityFileError` for an
        unreadable file or an empty token file."""
        environ = os.environ if environ is None else environ

        def name(setting: str) -> str:
            return field_prefix + (setting.replace("_", "-") if field_prefix.endswith("-") else setting)

        token = environ.get(TOKEN_ENV, "").strip() or None
        if auth_token_file:
            token = _read_file(name("auth_token_file"), auth_token_file).decode().strip()
            if not token:
                raise SecurityFileError(name("auth_token_file"), str(auth_token_file), f"{auth_token_file} is empty")
        files = {"tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file}
        if not (tls or tls_ca_file or tls_cert_file):
            return cls(auth_token=token)
        for setting in _TLS_FILES:
            if files[setting]:
                _read_file(name(setting), files[setting])
        return cls(auth_token=token, tls=True, tls_server_name=tls_server_name or None,
                   **{k: str(v) if v else None for k, v in files.items()})

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.auth_token}"),) if self.auth_token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (reading the files now), or None for a plaintext channel."""
        if not self.uses_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca_file), private_key=_read(self.tls_key_file),
                                            certificate_chain=_read(self.tls_cert_file))

    def channel_options(self) -> list[tuple[str, object]]:
        """Channel options: the name to check the server's certificate against, when given."""
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []


def _read(path: str | None) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def _read_file(setting: str, path: str | os.PathLike) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise SecurityFileError(setting, str(path), f"cannot read {path}: {exc.strerror or exc}") from None
