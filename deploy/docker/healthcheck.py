"""Container health check: exit 0 iff the teacher's grpc.health.v1 says SERVING.

    python /opt/eopd/healthcheck.py [--service eopd.v1.TeacherService] [--timeout 3]

The port comes from EOPD_TEACHER_GRPC_PORT (default 50051), as the server's own setting does.
Used by the images' HEALTHCHECK and by docker-compose.yml; Kubernetes probes gRPC health
natively (`grpc: port:`). Plaintext only: with TLS on (EOPD_TEACHER_TLS_CERT_FILE) use the HTTP
/readyz probe instead (see docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("EOPD_TEACHER_GRPC_PORT", "50051")))
    p.add_argument("--service", default="eopd.v1.TeacherService")
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
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
