"""Authentication, TLS and mutual TLS on the real teacher server."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eopd_common.client_security import ClientSecurity
from eopd_teacher.client import TeacherClient
from tests.pki import make_pki
from tests.procs import running_teacher

pytestmark = pytest.mark.integration
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"), "subjectAltName=IP:127.0.0.1,DNS:localhost")


@pytest.fixture(scope="module")
def tls_teacher(pki):
    """A teacher serving TLS with the PKI's server pair; read only by the tests that use it."""
    with running_teacher("tiny-random", "--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key")) as proc:
        yield proc


@pytest.fixture(scope="module")
def mtls_teacher(pki):
    """A teacher serving mutual TLS (client certificates signed by the PKI's CA); read only."""
    with running_teacher("tiny-random", "--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key"),
                         "--tls-client-ca-file", str(pki / "ca.pem")) as proc:
        yield proc


def _http_status(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> int:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bearer_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_teacher("tiny-random", "--auth-token-file", str(token_file)) as proc:
        for token in (None, "wrong"):
            with TeacherClient(proc.target, auth_token=token, retry_timeout=0) as c:
                for call in (c.info, lambda: c.score([("a", [1, 2, 3], 1)])):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.details()
                with pytest.raises(grpc.RpcError) as e:
                    list(c.score_stream([]))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with TeacherClient(proc.target, auth_token=TOKEN) as c:
            assert c.info().model_name == "tiny-random"
            assert c.score([("a", [1, 2, 3], 1)])[0].token_logprobs.shape == (2,)
        with grpc.insecure_channel(proc.target) as ch:  # probes need no token
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        assert _http_status(f"{proc.http}/readyz") == 200 and _http_status(f"{proc.http}/healthz") == 200
        assert _http_status(f"{proc.http}/metrics") == 401
        assert _http_status(f"{proc.http}/metrics", TOKEN) == 200
        assert TOKEN not in proc.log()  # never logged
        assert "bearer token required" in proc.log()


def _plain_http_refused(url: str) -> bool:
    """A plaintext HTTP request to a TLS port gets no HTTP answer (the TLS server drops it)."""
    import http.client

    try:
        with urllib.request.urlopen(url, timeout=5):
            return False
    except urllib.error.HTTPError:
        return False  # an HTTP status: the port spoke plain HTTP
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, OSError):
        return True


def test_tls_and_mutual_tls(pki, tls_teacher, mtls_teacher):
    """gRPC over TLS and mutual TLS; the HTTP side (issue 17 section 5) serves HTTPS with the same
    certificate (its ports file says so), verified by the CA, and no longer answers plain HTTP; under
    mutual TLS without a bearer token its probes answer (no client certificate needed: the kubelet's
    HTTPS probes have none) and /metrics is refused (403), since the HTTP side cannot require a
    client certificate the way gRPC does."""
    d = pki
    ca = ssl.create_default_context(cafile=str(d / "ca.pem"))
    proc = tls_teacher
    with TeacherClient(proc.target, tls_ca_file=str(d / "ca.pem")) as c:
        assert c.score([("a", [1, 2, 3], 1)])[0].entropies.shape == (2,)
    with TeacherClient(proc.target, retry_timeout=0, timeout=5) as plain:
        with pytest.raises(grpc.RpcError) as e:
            plain.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "TLS" in proc.log()
    assert proc.http == f"https://127.0.0.1:{proc.http_port}"
    https = f"https://localhost:{proc.http_port}"
    assert _http_status(f"{https}/readyz", context=ca) == 200 and _http_status(f"{https}/metrics", context=ca) == 200
    assert _plain_http_refused(f"http://127.0.0.1:{proc.http_port}/metrics")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # it is the teacher's certificate
        _http_status(f"{https}/readyz", context=ssl.create_default_context(cafile=str(d / "client.pem")))
    proc = mtls_teacher
    https = f"https://localhost:{proc.http_port}"
    assert _http_status(f"{https}/readyz", context=ca) == 200 and _http_status(f"{https}/healthz", context=ca) == 200
    assert _http_status(f"{https}/metrics", context=ca) == 403
    assert _plain_http_refused(f"http://127.0.0.1:{proc.http_port}/readyz")
    with TeacherClient(proc.target, tls_ca_file=str(d / "ca.pem"), retry_timeout=0, timeout=5) as no_cert:
        with pytest.raises(grpc.RpcError) as e:
            no_cert.info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with TeacherClient(proc.target, tls_ca_file=str(d / "ca.pem"), tls_cert_file=str(d / "client.pem"),
                       tls_key_file=str(d / "client.key")) as c:
        assert c.info().vocab_size == 49152
    assert "mutual TLS" in proc.log()


def test_tls_settings_validated(tmp_path):
    from eopd_teacher.settings_base import SettingsError, load_settings
    from eopd_teacher.settings import TeacherSettings

    with pytest.raises(SettingsError, match="together"):
        load_settings(TeacherSettings, None, {"tls_cert_file": str(tmp_path)})
    with pytest.raises(SettingsError, match="not a readable file"):
        load_settings(TeacherSettings, None, {"auth_token_file": str(tmp_path / "missing")})
    s = load_settings(TeacherSettings, None, {"auth_token": "abc"})
    assert "abc" not in repr(s) and s.bearer_token() == "abc"


def test_rollout_worker_sends_token_over_mutual_tls(tmp_path, pki):
    """The pipeline's worker reaches a teacher that requires a bearer token and a client
    certificate, with the credentials from the run config (token file, CA, client pair, server
    name override); with a wrong token it stops at once with exit 2 and names the settings."""
    from tests.trainer.pipeline_helpers import (
        committed_state,
        describe,
        overrides,
        spawn_learner,
        spawn_worker,
        trained_ids,
        wait_exit,
    )
    from tests.trainer.redis_helpers import running_redis

    d = pki
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-token\n")
    with running_teacher("tiny-random", "--auth-token-file", str(token_file), "--tls-cert-file", str(d / "server.pem"),
                         "--tls-key-file", str(d / "server.key"), "--tls-client-ca-file", str(d / "ca.pem")) as teacher, \
            running_redis() as redis_server:
        tls = [f"teacher.tls_ca_file={d / 'ca.pem'}", f"teacher.tls_cert_file={d / 'client.pem'}",
               f"teacher.tls_key_file={d / 'client.key'}", "teacher.tls_server_name=localhost"]
        bad = spawn_worker(overrides(tmp_path / "bad", redis_server.url, teacher.target, "tls-bad",
                                     f"teacher.auth_token_file={wrong_file}", "teacher.ready_timeout_s=120", *tls), "bad")
        assert wait_exit(bad, 60) == 2, describe(bad)
        assert "UNAUTHENTICATED" in bad.log() and "teacher.auth_token_file" in bad.log(), describe(bad)
        assert "not-the-token" not in bad.log()

        run_dir = tmp_path / "run"
        ov = overrides(run_dir, redis_server.url, teacher.target, "tls", "train.iterations=2",
                       f"teacher.auth_token_file={token_file}", *tls)
        learner, worker = spawn_learner(ov), spawn_worker(ov, "w0")
        try:
            assert wait_exit(learner, 300, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.stop()
            worker.stop()
        assert TOKEN not in worker.log() and TOKEN not in learner.log()
        # Mutual TLS with a token: the HTTP side is HTTPS and /metrics takes the token.
        ca = ssl.create_default_context(cafile=str(d / "ca.pem"))
        https = f"https://localhost:{teacher.http_port}"
        assert _http_status(f"{https}/metrics", context=ca) == 401
        assert _http_status(f"{https}/metrics", TOKEN, context=ca) == 200
    state = committed_state(run_dir)
    assert state["iteration"] == 2 and len(trained_ids(state)) > 0


def test_teacher_client_settings_are_validated(tmp_path, monkeypatch):
    from eopd_trainer.config import ConfigError, load_config

    monkeypatch.delenv("EOPD_TEACHER_AUTH_TOKEN", raising=False)

    tiny = "configs/tiny.yaml"
    with pytest.raises(ConfigError, match="teacher.tls_cert_file is set but teacher.tls_key_file is not"):
        load_config(tiny, ["teacher.tls_cert_file=/x.pem"])
    cfg = load_config(tiny, [f"teacher.tls_ca_file={tmp_path / 'missing.pem'}"])
    with pytest.raises(ConfigError, match="teacher.tls_ca_file: cannot read"):
        cfg.teacher.client_security()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="teacher.auth_token_file: .* is empty"):
        load_config(tiny, [f"teacher.auth_token_file={tmp_path / 'empty'}"]).teacher.client_security()
    assert load_config(tiny).teacher.client_security() == ClientSecurity()  # plaintext, no token
    monkeypatch.setenv("EOPD_TEACHER_AUTH_TOKEN", "from-env")
    assert load_config(tiny).teacher.client_security() == ClientSecurity(auth_token="from-env")
    sec = load_config(tiny, ["teacher.tls=true", "teacher.tls_server_name=teacher.example"]).teacher.client_security()
    assert sec.uses_tls and sec.tls is True and sec.tls_ca_file is None and sec.tls_server_name == "teacher.example"
    assert sec == ClientSecurity(auth_token="from-env", tls=True, tls_server_name="teacher.example")


def test_tls_files_under_home_reach_the_client(tmp_path, monkeypatch, pki):
    """A `~/` TLS path in the run configuration is read (checked at start) and used by the client
    from the same place: the client's credentials come from `ClientSecurity`, which expands `~`."""
    from eopd_trainer.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ca.pem").write_bytes((pki / "ca.pem").read_bytes())
    sec = load_config("configs/tiny.yaml", ["teacher.tls_ca_file=~/ca.pem"]).teacher.client_security()
    assert sec.tls_ca_file == "~/ca.pem" and sec.uses_tls
    with TeacherClient("127.0.0.1:1", security=sec) as c:
        assert c.security is sec and c._credentials is not None


def test_client_takes_security_or_the_same_keywords(tmp_path, pki):
    """`security=ClientSecurity(...)` and the keywords (auth_token=, tls_*=) build the same client:
    the same metadata (client id, then the bearer token), channel options and TLS; both at once is
    refused."""
    ca = str(pki / "ca.pem")
    sec = ClientSecurity(auth_token=TOKEN, tls_ca_file=ca, tls_server_name="localhost")
    with TeacherClient("127.0.0.1:1", client_id="me", auth_token=TOKEN, tls_ca_file=pki / "ca.pem",
                       tls_server_name="localhost") as by_keywords, \
            TeacherClient("127.0.0.1:1", client_id="me", security=sec) as by_security:
        assert by_keywords.security == sec
        for c in (by_keywords, by_security):
            assert c.metadata == (("x-eopd-client", "me"), ("authorization", f"Bearer {TOKEN}"))
            assert ("grpc.ssl_target_name_override", "localhost") in c._options and c._credentials is not None
        assert by_keywords._options == by_security._options
    with TeacherClient("127.0.0.1:1", client_id="me") as plain:
        assert plain.security == ClientSecurity() and plain.metadata == (("x-eopd-client", "me"),)
        assert plain._credentials is None
    with pytest.raises(TypeError, match="auth_token"):
        TeacherClient("127.0.0.1:1", security=sec, auth_token=TOKEN)


def test_teacher_cli_refuses_unusable_security_files_with_exit_2(tmp_path, capsys, monkeypatch):
    """`eopd-teacher info/score` read the token and TLS files before connecting: a missing file or
    an empty token file is a one-line error naming the flag, exit 2 (as other usage errors)."""
    from eopd_teacher.cli.main import main

    monkeypatch.delenv("EOPD_TEACHER_AUTH_TOKEN", raising=False)
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "in.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    missing = tmp_path / "missing.pem"
    cases = [
        (["info", "--auth-token-file", str(missing)], f"eopd-teacher info: --auth-token-file: cannot read {missing}: "),
        (["info", "--auth-token-file", str(tmp_path / "empty")], f"eopd-teacher info: --auth-token-file: {tmp_path / 'empty'} is empty"),
        (["score", "--input", str(tmp_path / "in.jsonl"), "--tls-ca-file", str(missing)],
         f"eopd-teacher score: --tls-ca-file: cannot read {missing}: "),
    ]
    for argv, message in cases:
        assert main([*argv, "--target", "127.0.0.1:1", "--timeout", "1"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def test_run_config_from_environment(monkeypatch):
    """EOPD_RUN_<SECTION>__<KEY> variables sit between the file and command-line overrides (how
    the deployments hand the workers their teacher credentials)."""
    from eopd_trainer.config import ConfigError, env_overrides, load_config

    monkeypatch.setenv("EOPD_RUN_TEACHER__TARGET", "dns:///teacher:50051")
    monkeypatch.setenv("EOPD_RUN_TEACHER__AUTH_TOKEN_FILE", "/etc/eopd/auth/token")
    monkeypatch.setenv("EOPD_RUN_SEED", "7")
    assert env_overrides() == ["seed=7", "teacher.auth_token_file=/etc/eopd/auth/token", "teacher.target=dns:///teacher:50051"]
    cfg = load_config("configs/tiny.yaml")
    assert (cfg.teacher.target, cfg.teacher.auth_token_file, cfg.seed) == ("dns:///teacher:50051", "/etc/eopd/auth/token", 7)
    assert load_config("configs/tiny.yaml", ["seed=3"]).seed == 3  # the command line wins
    monkeypatch.setenv("EOPD_RUN_TEACHER__TARGT", "x")
    with pytest.raises(ConfigError, match="teacher.targt: unknown key"):
        load_config("configs/tiny.yaml")


def _healthcheck(port: int, **env: str) -> subprocess.CompletedProcess:
    """deploy/docker/healthcheck.py (the images' HEALTHCHECK) as the container runs it: the teacher's
    own settings and the EOPD_HEALTHCHECK_* variables in the environment, nothing else EOPD_*."""
    import os
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"
    base = {k: v for k, v in os.environ.items() if not k.startswith("EOPD_")}
    return subprocess.run([sys.executable, str(script), "--timeout", "5"], capture_output=True, text=True, timeout=60,
                          env={**base, "EOPD_TEACHER_GRPC_PORT": str(port), **env})


def test_container_health_check_speaks_tls_when_the_teacher_does(pki, tls_teacher, mtls_teacher):
    """With the teacher's TLS settings in the environment (what docker-compose.tls.yml sets), the
    health check connects over TLS, verifies the teacher with EOPD_HEALTHCHECK_TLS_CA_FILE and
    reports SERVING; with mutual TLS it presents the client pair. Misconfigurations exit 1 naming
    the variable to set; a plaintext check of a TLS teacher is unhealthy."""
    d = pki
    server = {"EOPD_TEACHER_TLS_CERT_FILE": str(d / "server.pem"), "EOPD_TEACHER_TLS_KEY_FILE": str(d / "server.key")}
    port = tls_teacher.grpc_port
    ok = _healthcheck(port, **server, EOPD_HEALTHCHECK_TLS_CA_FILE=str(d / "ca.pem"))
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    no_ca = _healthcheck(port, **server)
    assert no_ca.returncode == 1 and "EOPD_HEALTHCHECK_TLS_CA_FILE" in no_ca.stderr
    plain = _healthcheck(port)  # the old plaintext check against a TLS teacher
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    wrong_ca = _healthcheck(port, **server, EOPD_HEALTHCHECK_TLS_CA_FILE=str(d / "client.pem"))
    assert wrong_ca.returncode == 1 and "unhealthy" in wrong_ca.stderr
    wrong_name = _healthcheck(port, **server, EOPD_HEALTHCHECK_TLS_CA_FILE=str(d / "ca.pem"),
                              EOPD_HEALTHCHECK_TLS_SERVER_NAME="not-the-teacher")
    assert wrong_name.returncode == 1 and "unhealthy" in wrong_name.stderr
    missing = _healthcheck(port, **server, EOPD_HEALTHCHECK_TLS_CA_FILE=str(d / "missing.pem"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr and "missing.pem" in missing.stderr
    mtls = {**server, "EOPD_TEACHER_TLS_CLIENT_CA_FILE": str(d / "ca.pem"), "EOPD_HEALTHCHECK_TLS_CA_FILE": str(d / "ca.pem")}
    proc = mtls_teacher
    no_pair = _healthcheck(proc.grpc_port, **mtls)
    assert no_pair.returncode == 1 and "EOPD_HEALTHCHECK_TLS_CERT_FILE" in no_pair.stderr
    ok = _healthcheck(proc.grpc_port, **mtls, EOPD_HEALTHCHECK_TLS_CERT_FILE=str(d / "client.pem"),
                      EOPD_HEALTHCHECK_TLS_KEY_FILE=str(d / "client.key"))
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr


def test_serve_auth_token_on_the_command_line_warns_and_empty_tokens_fail_closed(tmp_path, capsys, monkeypatch):
    """`serve --auth-token TOKEN` still works but warns (argv is readable by every local user) and
    points to the file and the environment variable, without echoing the token. An empty token
    (file or value) is refused at start (exit 2) instead of silently turning authentication off."""
    from eopd_teacher.cli.main import ARGV_TOKEN_WARNING, main

    monkeypatch.delenv("EOPD_TEACHER_AUTH_TOKEN", raising=False)
    # An invalid port stops `serve` at its settings, after the warning and before any model loads.
    assert main(["serve", "--auth-token", TOKEN, "--grpc-port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(ARGV_TOKEN_WARNING + "\n") and "--auth-token-file" in err and "EOPD_TEACHER_AUTH_TOKEN" in err
    assert TOKEN not in err and "grpc_port" in err
    assert main(["serve", "--auth-token-file", str(tmp_path / "x"), "--grpc-port", "70000"]) == 2
    assert "warning" not in capsys.readouterr().err  # the file is the recommended way: no warning
    (tmp_path / "empty").write_text("\n")
    from eopd_teacher.settings_base import SettingsError, load_settings
    from eopd_teacher.settings import TeacherSettings

    with pytest.raises(SettingsError, match=f"auth_token_file: {tmp_path / 'empty'} is empty"):
        load_settings(TeacherSettings, None, {"auth_token_file": str(tmp_path / "empty")})
    monkeypatch.setenv("EOPD_TEACHER_AUTH_TOKEN", " ")
    with pytest.raises(SettingsError, match="auth_token: empty"):
        load_settings(TeacherSettings)
