"""Container health check: exit 0 iff the teacher's grpc.health.v1 says SERVING.

    python /opt/eopd/healthcheck.py [--service eopd.v1.TeacherService] [--timeout 3]

Reads the teacher's own settings from the environment, under the same names the server reads:
EOPD_TEACHER_GRPC_PORT (default 50051); EOPD_TEACHER_TLS_CERT_FILE set = the server speaks TLS, so
the check does too; EOPD_TEACHER_TLS_CLIENT_CA_FILE set = mutual TLS, so the check presents a client
certificate. What only a client has comes from EOPD_HEALTHCHECK_* variables:

    EOPD_HEALTHCHECK_TLS_CA_FILE      CA that signed the teacher's certificate (required with TLS)
    EOPD_HEALTHCHECK_TLS_SERVER_NAME  name to verify the certificate against (default: localhost)
    EOPD_HEALTHCHECK_TLS_CERT_FILE    client certificate and key (required with mutual TLS)
    EOPD_HEALTHCHECK_TLS_KEY_FILE

Health is exempt from the bearer token. Used by the images' HEALTHCHECK and by docker-compose.yml
(docker-compose.tls.yml sets the variables); Kubernetes probes gRPC health natively (`grpc: port:`),
or HTTPS /readyz with TLS on. Exit 1 with the reason on stderr when unhealthy or misconfigured.
"""

from __future__ import annotations

import argparse
import os
import sys

_TLS_ON = "EOPD_TEACHER_TLS_CERT_FILE"
_MTLS_ON = "EOPD_TEACHER_TLS_CLIENT_CA_FILE"


class ConfigError(Exception):
    pass


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not data.strip():
        raise ConfigError(f"{what}: {path} is empty")
    return data


def _channel(args: argparse.Namespace):
    import grpc

    address = f"{args.host}:{args.port}"
    if not _env(_TLS_ON):
        return grpc.insecure_channel(address)
    if not args.tls_ca_file:
        raise ConfigError(f"TLS is on ({_TLS_ON} is set) but no CA to verify the teacher with: "
                          "set EOPD_HEALTHCHECK_TLS_CA_FILE (or --tls-ca-file)")
    root = _read(args.tls_ca_file, "EOPD_HEALTHCHECK_TLS_CA_FILE")
    cert = key = None
    if _env(_MTLS_ON) or args.tls_cert_file or args.tls_key_file:
        if not (args.tls_cert_file and args.tls_key_file):
            raise ConfigError(f"mutual TLS is on ({_MTLS_ON} is set): set EOPD_HEALTHCHECK_TLS_CERT_FILE and "
                              "EOPD_HEALTHCHECK_TLS_KEY_FILE (a client certificate the teacher accepts)"
                              if _env(_MTLS_ON) else
                              "EOPD_HEALTHCHECK_TLS_CERT_FILE and EOPD_HEALTHCHECK_TLS_KEY_FILE go together")
        cert = _read(args.tls_cert_file, "EOPD_HEALTHCHECK_TLS_CERT_FILE")
        key = _read(args.tls_key_file, "EOPD_HEALTHCHECK_TLS_KEY_FILE")
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(address, creds, options=options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("EOPD_TEACHER_GRPC_PORT", "50051")))
    p.add_argument("--service", default="eopd.v1.TeacherService")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca-file", default=_env("EOPD_HEALTHCHECK_TLS_CA_FILE"))
    p.add_argument("--tls-server-name", default=_env("EOPD_HEALTHCHECK_TLS_SERVER_NAME") or "localhost")
    p.add_argument("--tls-cert-file", default=_env("EOPD_HEALTHCHECK_TLS_CERT_FILE"))
    p.add_argument("--tls-key-file", default=_env("EOPD_HEALTHCHECK_TLS_KEY_FILE"))
    args = p.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = _channel(args)
    except ConfigError as exc:
        print(f"misconfigured: {exc}", file=sys.stderr)
        return 1
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
