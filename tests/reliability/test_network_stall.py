"""A stalled network path between a rollout worker and the teacher: a TCP proxy in the test stops
forwarding bytes without closing either connection (what a dead middlebox or a partitioned link
does). The worker's stream deadline (`teacher.timeout_s`) fires, the worker abandons the stream,
reconnects and re-sends the unanswered requests; once the path is restored the run completes with
every rollout trained exactly once."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from tests.procs import free_port
from tests.trainer.pipeline_helpers import (
    committed_state,
    describe,
    overrides,
    spawn_learner,
    spawn_worker,
    trained_ids,
    wait_exit,
    wait_for_iterations,
)
from tests.trainer.redis_helpers import running_redis

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


class StallingProxy:
    """127.0.0.1:<port> -> upstream. `stall()` stops forwarding in both directions (connections stay
    open, new ones are accepted and left silent); `restore()` resumes forwarding."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.port = free_port()
        self.forwarding = threading.Event()
        self.forwarding.set()
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.conns: list[socket.socket] = []
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stall(self) -> None:
        self.forwarding.clear()

    def restore(self) -> None:
        self.forwarding.set()

    def close(self) -> None:
        self.closed.set()
        self.forwarding.set()
        for s in [self.sock, *self.conns]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                self.forwarding.wait()
                data = src.recv(65536)
                if not data:
                    break
                self.forwarding.wait()  # a chunk read just before the stall is held, not forwarded
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


def test_stalled_teacher_path_deadline_fires_and_run_recovers(tmp_path, tiny_teacher):
    iterations, timeout_s = 4, 3.0
    proxy = StallingProxy(("127.0.0.1", tiny_teacher.grpc_port))
    with running_redis() as server:
        run_dir, ns = tmp_path / "run", "stall"
        ov = overrides(run_dir, server.url, proxy.target, ns, f"train.iterations={iterations}",
                       f"teacher.timeout_s={timeout_s}", "teacher.retry_timeout_s=120")
        learner = spawn_learner(ov)
        worker = spawn_worker(ov, "w0")
        try:
            wait_for_iterations(run_dir, 1, 180, learner, worker)
            proxy.stall()
            # The stall lasts longer than several deadlines: the worker abandons the stream more
            # than once (new connections through the stalled proxy stay silent too).
            deadline = time.monotonic() + 60
            while worker.log().count("abandoning the stream") < 2:
                assert time.monotonic() < deadline and worker.alive(), describe(worker)
                time.sleep(0.2)
            connections_during_stall = proxy.connections
            proxy.restore()
            assert wait_exit(learner, 240, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.stop()
            worker.stop()
            proxy.close()
    state = committed_state(run_dir)
    assert state["iteration"] == iterations
    ids = trained_ids(state)  # no id twice
    assert set(ids) == {f"t{t}-s{s}" for t in range(4 * iterations) for s in range(2)}
    assert connections_during_stall >= 2  # reconnected through the proxy
    assert "no answer from the teacher for 3.0s" in worker.log()
