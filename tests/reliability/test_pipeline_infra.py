"""Infrastructure failures under the real pipeline (tiny config: learner + rollout worker + teacher
subprocesses): Redis SIGKILLed and restarted with append-only persistence, a full disk while
checkpointing, a slow learner (backpressure), a password-protected Redis."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from eopd_trainer.queue.streams import Keys

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

pytestmark = pytest.mark.integration


def expected_ids(iterations: int) -> set[str]:
    return {f"t{t}-s{s}" for t in range(4 * iterations) for s in range(2)}


def assert_exactly_once(run_dir: Path, iterations: int) -> dict:
    state = committed_state(run_dir)
    assert state["iteration"] == iterations
    ids = trained_ids(state)  # fails if an id is in two iterations
    assert set(ids) == expected_ids(iterations), sorted(set(ids) ^ expected_ids(iterations))
    assert state["optimizer_steps"] == state["global_steps"] == 2 * iterations
    return state


class PrivateRedis:
    """A redis-server on a fixed port and directory that can be SIGKILLed and restarted in place."""

    def __init__(self, *extra: str, auth: str = "", tls_ca: Path | None = None):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="eopd-redis-"))
        self.extra = extra
        self.popen: subprocess.Popen | None = None
        self.auth = auth  # "user:password" of the URL
        self.tls_ca = tls_ca  # TLS on self.port (the plain port is off) when set

    @property
    def url(self) -> str:
        auth = f"{self.auth}@" if self.auth else ""
        if self.tls_ca:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def start(self, timeout: float = 20.0) -> None:
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls_ca else ["--port", str(self.port)]
        args = [shutil.which("redis-server") or "redis-server", *ports, "--bind", "127.0.0.1",
                "--save", "", "--dir", str(self.dir), *self.extra]
        with open(self.dir / "redis.log", "ab") as out:
            self.popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, (self.dir / "redis.log").read_text(errors="replace")
            with contextlib.suppress(Exception):
                if self.client().ping():
                    return
            time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _deployed_appendfsync() -> set[str]:
    """The appendfsync policies docker-compose.yml and the Kubernetes base deploy Redis with."""
    import re

    root = Path(__file__).resolve().parents[2]
    compose = re.findall(r"--appendfsync (\w+)", (root / "docker-compose.yml").read_text())
    k8s = re.findall(r"- --appendfsync\s+- \"?(\w+)", (root / "deploy" / "k8s" / "base" / "redis.yaml").read_text())
    assert compose and k8s, "no --appendfsync found in docker-compose.yml / deploy/k8s/base/redis.yaml"
    return set(compose) | set(k8s)


@pytest.mark.chaos
@pytest.mark.parametrize("fsync", ["always", "everysec"])
def test_redis_sigkill_restart_with_aof_loses_nothing(tmp_path, tiny_teacher, fsync):
    """Redis (appendonly yes; appendfsync `always`, and `everysec`, what compose and Kubernetes
    deploy) is SIGKILLed mid-run and restarted on the same port and directory: the clients
    reconnect, no scored rollout is lost, every rollout is trained exactly once. (everysec loses
    nothing to a killed redis-server: the AOF is written before the reply, only its fsync is
    deferred; what a host crash can cost is in docs/reliability.md.)"""
    if fsync == "everysec":
        assert _deployed_appendfsync() == {"everysec"}, "the deployments changed their appendfsync: update this test"
    iterations = 4
    server = PrivateRedis("--appendonly", "yes", "--appendfsync", fsync)
    server.start()
    run_dir, ns = tmp_path / "run", "redis-restart"
    ov = overrides(run_dir, server.url, tiny_teacher.target, ns, f"train.iterations={iterations}")
    worker = spawn_worker(ov, "w0")
    learner = spawn_learner(ov)
    try:
        wait_for_iterations(run_dir, 1, 180, learner, worker)
        backlog = server.client().xlen(Keys(ns).rollouts)
        server.kill()
        time.sleep(1.5)  # both clients see connection errors and back off
        server.start()
        assert server.client().xlen(Keys(ns).rollouts) >= 0
        assert wait_exit(learner, 240, worker) == 0, describe(learner, worker)
        assert wait_exit(worker, 60) == 0, describe(worker)
    finally:
        learner.stop()
        worker.stop()
        client_state = None
        with contextlib.suppress(Exception):
            client = server.client()
            client_state = (client.xlen(Keys(ns).rollouts), client.xpending(Keys(ns).rollouts, "learner")["pending"],
                            client.xlen(Keys(ns).dead))
        server.stop()
    print(f"rollout backlog at the kill: {backlog}")
    assert_exactly_once(run_dir, iterations)
    assert client_state == (0, 0, 0), client_state  # nothing left over, nothing dead-lettered


def _tree_digest(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _mount_tmpfs(path: Path, size: int, remount: bool = False) -> None:
    opts = f"remount,size={size}" if remount else f"size={size}"
    args = ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)] if not remount else ["mount", "-o", opts, str(path)]
    res = subprocess.run(args, capture_output=True, text=True, check=False)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {res.stderr.strip()}")


@pytest.mark.chaos
@pytest.mark.parametrize("full_disk", ["tmpfs", "fault"])
def test_disk_full_during_checkpoint_keeps_previous_checkpoint(tmp_path, tiny_teacher, full_disk):
    """The second checkpoint of a learner process fails for lack of space: with `tmpfs`, the
    checkpoint directory is a real tmpfs with room for one checkpoint and a half (needs root); with
    `fault`, the run config's `checkpoint.write` fault raises ENOSPC inside the checkpoint writer
    after DeepSpeed wrote its shards (runs everywhere). Either way: a clear error (exit status 4),
    the partial directory removed, the first checkpoint committed and byte-identical, and a
    restart with space resumes from it."""
    from eopd_trainer.learner.checkpoint import read_state

    with running_private_redis() as server:
        run_dir, ns = tmp_path / "run", "disk-full"
        ckpt = run_dir / "checkpoints"
        ckpt.mkdir(parents=True)
        tmpfs = full_disk == "tmpfs"
        if tmpfs:
            _mount_tmpfs(ckpt, 512 * 2**20)
        procs = []
        try:
            base = overrides(run_dir, server.url, tiny_teacher.target, ns)
            # 1. one iteration, committed.
            worker = spawn_worker(base, "w0")
            learner = spawn_learner([*base, "train.iterations=1"])
            procs += [worker, learner]
            assert wait_exit(learner, 180, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
            used = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
            before = _tree_digest(ckpt / "iter000001")
            if tmpfs:
                _mount_tmpfs(ckpt, used + used // 2, remount=True)  # room for half of another checkpoint
            fault = ["faults=[{point: checkpoint.write, action: raise, iteration: 2}]"] if not tmpfs else []

            # 2. the next checkpoint does not fit.
            ov = [*base, "train.iterations=3"]
            server.client().delete(Keys(ns).done)  # else the new worker sees the first run's "done" and exits
            worker = spawn_worker(ov, "w0")
            learner = spawn_learner([*ov, *fault])
            procs += [worker, learner]
            assert wait_exit(learner, 180, worker) == 4, describe(learner, worker)
            log = learner.log()
            assert "No space left on device" in log and "writing checkpoint" in log, log[-3000:]
            assert f"last committed checkpoint ({ckpt / 'iter000001'}) is intact" in log, log[-3000:]
            assert not (ckpt / "iter000002").exists()
            assert (ckpt / "COMMITTED").read_text().strip() == "iter000001"
            assert read_state(ckpt).iteration == 1
            assert _tree_digest(ckpt / "iter000001") == before

            # 3. space again: the restarted learner loads iteration 1's checkpoint and finishes.
            if tmpfs:
                _mount_tmpfs(ckpt, 512 * 2**20, remount=True)
            learner = spawn_learner(ov)
            procs.append(learner)
            assert wait_exit(learner, 240, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
            assert "resumed from" in learner.log() and "(iteration 1)" in learner.log()
            assert_exactly_once(run_dir, 3)
        finally:
            for p in procs:
                p.stop()
            if tmpfs:
                subprocess.run(["umount", "-l", str(ckpt)], capture_output=True, check=False)


@contextlib.contextmanager
def running_private_redis(*extra: str):
    server = PrivateRedis(*extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.chaos
def test_stalled_learner_backpressure_bounds_stream_and_worker_memory(tmp_path, tiny_teacher):
    """The learner is stopped (SIGSTOP) while tasks for several iterations are out (async mode,
    max_staleness 3): the worker fills the rollouts stream up to queue.max_backlog and waits; the
    stream length never exceeds the bound and the worker's RSS stays flat. After SIGCONT the run
    finishes with no rollout trained twice."""
    import signal

    max_backlog, iterations = 12, 5  # >= batch_size x checkpoint.every (8), enforced by the config
    with running_private_redis() as server:
        run_dir, ns = tmp_path / "run", "backpressure"
        mport = free_port()
        ov = overrides(run_dir, server.url, tiny_teacher.target, ns, "mode=async", "max_staleness=3",
                       f"queue.max_backlog={max_backlog}", f"train.iterations={iterations}",
                       # A learner stopped longer than its lease loses the namespace by design (it
                       # exits 6 on SIGCONT: test_learner_guards.py); this stall is up to ~2 min.
                       "queue.lease_ttl_s=600")
        client = server.client()
        learner = spawn_learner(ov)
        worker = spawn_worker(["--prometheus-port", str(mport), *ov], "w0")
        try:
            wait_for_iterations(run_dir, 1, 180, learner, worker)
            learner.signal(signal.SIGSTOP)
            # The worker produces until the stream is full, then waits.
            deadline = time.monotonic() + 90
            while client.xlen(Keys(ns).rollouts) < max_backlog:
                assert time.monotonic() < deadline, describe(worker)
                time.sleep(0.2)
            time.sleep(4)  # the producer fills its bounded queue of batches, then blocks too
            waits0 = _metric(mport, "eopd_rollout_backpressure_waits_total")
            lengths, rss = [], []
            for _ in range(50):  # 10 s with the learner stalled
                lengths.append(client.xlen(Keys(ns).rollouts))
                rss.append(_rss_mb(worker.popen.pid))
                time.sleep(0.2)
            waits1 = _metric(mport, "eopd_rollout_backpressure_waits_total")
            assert max(lengths) <= max_backlog, lengths
            assert waits1 > waits0, (waits0, waits1)  # the worker is waiting, not failing
            assert worker.alive()
            # Memory does not grow while the worker waits (MB; transient sampling allocations aside).
            first, second = max(rss[:25]), max(rss[25:])
            assert second <= first + 30, rss
            print(f"stalled: stream {min(lengths)}..{max(lengths)} (bound {max_backlog}), worker RSS peak {first:.0f} MB "
                  f"then {second:.0f} MB, backpressure waits {waits0:.0f} -> {waits1:.0f}")
            learner.signal(signal.SIGCONT)
            assert wait_exit(learner, 240, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.signal(signal.SIGCONT)
            learner.stop()
            worker.stop()
        state = committed_state(run_dir)
        assert state["iteration"] == iterations
        assert len(trained_ids(state)) == 8 * iterations  # no id twice
        assert client.xpending(Keys(ns).rollouts, "learner")["pending"] == 0


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    d = tmp_path_factory.mktemp("redis-pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=eopd-test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=redis", "-keyout", str(d / "server.key"),
            "-out", str(d / "server.csr"))
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-days", "2", "-extfile", str(d / "server.ext"), "-out", str(d / "server.pem"))
    return d


def test_redis_acl_password_and_tls_end_to_end(tmp_path, tiny_teacher, pki):
    """A redis-server with TLS only (no plain port), the default user disabled and an ACL user
    limited to the run's key namespace: learner and worker, configured only through
    queue.redis_url (rediss://user:password@host:port/0?ssl_ca_certs=...), train 2 iterations.
    A wrong password is refused by the server."""
    import redis
    acl = ["--user", "default", "off", "--user", "eopd", "on", ">s3cret", "~acl:*", "&*", "+@all",
           "--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key"),
           "--tls-ca-cert-file", str(pki / "ca.pem"), "--tls-auth-clients", "no"]
    server = PrivateRedis(*acl, auth="eopd:s3cret", tls_ca=pki / "ca.pem")
    server.start()
    run_dir = tmp_path / "run"
    ov = overrides(run_dir, server.url, tiny_teacher.target, "acl", "train.iterations=2")
    procs = []
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(server.url.replace("s3cret", "wrong")).ping()
        with pytest.raises(redis.exceptions.ConnectionError):  # TLS only: the plain protocol is refused
            redis.Redis.from_url(f"redis://eopd:s3cret@127.0.0.1:{server.port}/0", socket_timeout=5).ping()

        worker = spawn_worker(ov, "w0")
        learner = spawn_learner(ov)
        procs += [worker, learner]
        assert wait_exit(learner, 180, worker) == 0, describe(learner, worker)
        assert wait_exit(worker, 60) == 0, describe(worker)
        state = committed_state(run_dir)
        assert state["iteration"] == 2 and len(trained_ids(state)) == 16
        client = server.client()
        assert all(k.startswith(b"acl:") for k in client.keys("*"))
    finally:
        for p in procs:
            p.stop()
        server.stop()
