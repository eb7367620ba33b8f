"""`eopd_common.client_security.ClientSecurity`: settings that name files (the token file, else the
environment; an empty token file refused; TLS files readable at start, errors naming the setting),
and what a gRPC channel gets from it (metadata, credentials, options), checked end to end against an
in-process mutual-TLS server."""

from __future__ import annotations

import dataclasses
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from eopd_common.client_security import TOKEN_ENV, ClientSecurity, SecurityFileError
from tests.pki import make_pki

TOKEN = "s3cret-token-for-tests"


def test_fields_are_the_clients_keywords():
    assert [f.name for f in dataclasses.fields(ClientSecurity)] == [
        "auth_token", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name"]
    s = ClientSecurity()
    assert not s.uses_tls and s.metadata() == () and s.channel_credentials() is None and s.channel_options() == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tls = True  # type: ignore[misc]


def test_token_file_is_read_stripped_and_wins_over_the_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")
    s = ClientSecurity.from_files(auth_token_file=f, environ={TOKEN_ENV: "from-env"})
    assert s == ClientSecurity(auth_token=TOKEN)
    assert s.metadata() == (("authorization", f"Bearer {TOKEN}"),)
    assert TOKEN not in repr(s)  # the token is never printed with the settings
    assert ClientSecurity.from_files(auth_token_file=str(f), environ={}) == ClientSecurity(auth_token=TOKEN)


def test_token_from_the_environment_without_a_file(monkeypatch):
    assert ClientSecurity.from_files(environ={TOKEN_ENV: " from-env \n"}) == ClientSecurity(auth_token="from-env")
    assert ClientSecurity.from_files(environ={TOKEN_ENV: "  "}) == ClientSecurity()  # blank: no token
    assert ClientSecurity.from_files(auth_token_file="", environ={}) == ClientSecurity()  # "" is unset
    monkeypatch.setenv(TOKEN_ENV, "process-env")
    assert ClientSecurity.from_files().auth_token == "process-env"  # default: os.environ
    monkeypatch.delenv(TOKEN_ENV)
    assert ClientSecurity.from_files() == ClientSecurity()


def test_empty_or_missing_token_file_is_refused_naming_the_setting(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecurityFileError, match=r"^teacher\.auth_token_file: .*empty is empty$") as e:
        ClientSecurity.from_files(auth_token_file=str(empty), environ={TOKEN_ENV: "from-env"}, field_prefix="teacher.")
    assert isinstance(e.value, ValueError) and e.value.field == "teacher.auth_token_file" and e.value.path == str(empty)
    missing = tmp_path / "missing"
    with pytest.raises(SecurityFileError) as e:
        ClientSecurity.from_files(auth_token_file=missing, environ={}, field_prefix="--")
    assert str(e.value) == f"--auth-token-file: cannot read {missing}: No such file or directory"
    assert e.value.field == "--auth-token-file"
    with pytest.raises(SecurityFileError, match=r"^auth_token_file: cannot read .*: Is a directory$"):
        ClientSecurity.from_files(auth_token_file=tmp_path, environ={})


@pytest.mark.parametrize("setting", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_tls_files_must_be_readable_at_start(tmp_path, setting):
    files = {}
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("-----BEGIN-----\n")
    files[setting] = tmp_path / "missing.pem"
    with pytest.raises(SecurityFileError) as e:
        ClientSecurity.from_files(**files, environ={}, field_prefix="teacher.")
    assert str(e.value) == f"teacher.{setting}: cannot read {files[setting]}: No such file or directory"
    assert e.value.field == f"teacher.{setting}"


def test_tls_is_on_with_tls_a_ca_or_a_client_certificate(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("ca")
    s = ClientSecurity.from_files(tls=True, tls_server_name="teacher.example", environ={})
    assert s == ClientSecurity(tls=True, tls_server_name="teacher.example")
    assert s.uses_tls and s.tls_ca_file is None
    assert s.channel_options() == [("grpc.ssl_target_name_override", "teacher.example")]
    s = ClientSecurity.from_files(tls_ca_file=ca, tls_cert_file="", tls_key_file="", tls_server_name="", environ={})
    assert s == ClientSecurity(tls=True, tls_ca_file=str(ca)) and s.channel_options() == []
    assert ClientSecurity(tls_cert_file="c.pem").uses_tls and not ClientSecurity(tls_key_file="k.pem").uses_tls


def test_without_tls_the_tls_settings_are_dropped(tmp_path):
    """As the workers' settings always were: a server name or a lone key without TLS means nothing
    (the key is not even read)."""
    s = ClientSecurity.from_files(tls_server_name="teacher.example", tls_key_file=tmp_path / "missing", environ={})
    assert s == ClientSecurity()


def test_credentials_read_the_files(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked until the handshake")
    assert isinstance(ClientSecurity(tls_ca_file=str(ca)).channel_credentials(), grpc.ChannelCredentials)
    assert isinstance(ClientSecurity(tls=True).channel_credentials(), grpc.ChannelCredentials)  # system roots
    with pytest.raises(FileNotFoundError):
        ClientSecurity(tls_ca_file=str(tmp_path / "gone.pem")).channel_credentials()


# -- end to end: a mutual-TLS server that wants the bearer token ------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for the name teacher.example only, and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"), "subjectAltName=DNS:teacher.example")


class _WantsToken(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        if (("authorization", f"Bearer {TOKEN}")) in tuple(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bearer token required")

        return grpc.unary_unary_rpc_method_handler(deny)


@pytest.fixture(scope="module")
def mtls_server(pki):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[_WantsToken()])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
                                        root_certificates=(pki / "ca.pem").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _check(target: str, security: ClientSecurity) -> grpc.StatusCode:
    with grpc.secure_channel(target, security.channel_credentials(), options=security.channel_options()) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), metadata=security.metadata(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_mutual_tls_channel_with_token_and_server_name(pki, mtls_server, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    files = dict(tls_ca_file=pki / "ca.pem", tls_cert_file=pki / "client.pem", tls_key_file=pki / "client.key")
    security = ClientSecurity.from_files(auth_token_file=token, tls_server_name="teacher.example", environ={}, **files)
    assert _check(mtls_server, security) == grpc.StatusCode.OK
    # Each part is needed: the token, the name the certificate carries, the client certificate.
    assert _check(mtls_server, dataclasses.replace(security, auth_token=None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _check(mtls_server, dataclasses.replace(security, tls_server_name=None)) == grpc.StatusCode.UNAVAILABLE
    no_client_cert = dataclasses.replace(security, tls_cert_file=None, tls_key_file=None)
    assert _check(mtls_server, no_client_cert) == grpc.StatusCode.UNAVAILABLE
