"""The teacher secure by default (issue 49, ask 2), against real `eopd-teacher serve` processes.

- Without a token, client certificates or the explicit opt-out, `serve` refuses to start (exit 2,
  before loading anything) and says how to fix it; with the opt-out (here its environment variable)
  it serves and logs a loud INSECURE warning.
- `--auth-token-file PATH --create-token` creates PATH (0600, a new random token) and requires it:
  a call without it is UNAUTHENTICATED, an HTTP POST without it 401 before its body is read.
- The token holder is a client apart from a stranger at the same address: a stranger holding its
  share of health Watch streams from two loopback addresses (127.0.0.1 and ::1: one client) leaves
  the holder's own share whole (`token@loopback`, `serving/shares.py`)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time

import grpc
import pytest

from tests.os_probes import has_ipv6_loopback
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eopd_teacher.client import TeacherClient
from tests.procs import ROOT, start_teacher

pytestmark = pytest.mark.integration

LIMIT, SHARE = 8, 4  # --max-health-watches, and one client's share of it (max_client_share 0.5)


def _env_without_teacher_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EOPD_TEACHER_")}


def test_serve_refuses_to_start_without_a_token_or_the_opt_out():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "eopd_teacher.cli", "serve", "--model", "tiny-random", "--grpc-port", "0",
                          "--http-port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=_env_without_teacher_settings())
    assert out.returncode == 2, out.stderr[-2000:]
    assert "no client authentication" in out.stderr and "--insecure-no-auth" in out.stderr, out.stderr[-2000:]
    assert "--auth-token-file FILE, with --create-token" in out.stderr
    assert "listening" not in out.stderr  # refused before binding anything
    assert time.monotonic() - started < 60


def test_the_opt_out_serves_and_says_so_loudly():
    t = start_teacher("tiny-random", env={"EOPD_TEACHER_INSECURE_NO_AUTH": "1"}, wait=False)
    try:
        deadline = time.monotonic() + 60
        while "INSECURE: serving with no client authentication" not in t.log():
            assert t.alive() and time.monotonic() < deadline, t.log()[-3000:]
            time.sleep(0.1)
        assert "WARNING" in next(line for line in t.log().splitlines() if "INSECURE" in line)
    finally:
        t.stop()


def test_create_token_requires_it_and_keys_its_holder_apart_from_a_stranger(tmp_path):
    if not has_ipv6_loopback():
        pytest.skip("needs the IPv6 loopback (::1) for the stranger's second address")
    token_file = tmp_path / "teacher.token"
    t = start_teacher("tiny-random", "--host", "::", "--auth-token-file", str(token_file), "--create-token",
                      "--max-health-watches", str(LIMIT), "--grace-seconds", "2", env=_env_without_teacher_settings())
    try:
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64 and int(token, 16) >= 0
        port = t.target.rsplit(":", 1)[1]

        with TeacherClient(t.target, retry_overload=False) as stranger, pytest.raises(grpc.RpcError) as err:
            stranger.score([("s", [1, 2, 3, 4], 1)])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with TeacherClient(t.target, auth_token=token) as holder:
            assert len(holder.score([("s", [1, 2, 3, 4], 1)])[0].token_logprobs) == 3
        r = requests.post(f"{t.http}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 0}, timeout=30)
        assert r.status_code == 401, r.text[:300]

        asyncio.run(_watches(f"127.0.0.1:{port}", f"[::1]:{port}", token))
    finally:
        t.stop()


async def _watches(v4: str, v6: str, token: str) -> None:
    """The stranger opens LIMIT Watch streams from two loopback addresses: SHARE are served (one
    client, `loopback`), the rest refused naming that share; the holder, at the same address, gets
    its own share beside them."""
    request = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.insecure_channel(v4) as ch4, grpc.aio.insecure_channel(v6) as ch6:
        stubs = [health_pb2_grpc.HealthStub(ch4), health_pb2_grpc.HealthStub(ch6)]
        calls, refused = [], []

        async def open_one(stub, metadata=()) -> None:
            call = stub.Watch(request, timeout=120, metadata=metadata)
            try:
                assert (await asyncio.wait_for(call.read(), 60)).status == health_pb2.HealthCheckResponse.SERVING
                calls.append(call)
            except grpc.aio.AioRpcError as e:
                refused.append((e.code(), e.details()))

        await asyncio.gather(*(open_one(stubs[i % 2]) for i in range(LIMIT)))
        assert len(calls) == SHARE and len(refused) == LIMIT - SHARE, refused
        assert refused[0] == (grpc.StatusCode.RESOURCE_EXHAUSTED, f"client loopback holds {SHARE} health Watch streams, "
                              f"its share of max_health_watches ({LIMIT} x max_client_share = {SHARE}); retry later")
        mine = (("authorization", f"Bearer {token}"),)
        refused.clear()
        await asyncio.gather(*(open_one(stubs[0], mine) for _ in range(SHARE)))
        assert not refused and len(calls) == 2 * SHARE, refused
        for call in calls:
            call.cancel()
