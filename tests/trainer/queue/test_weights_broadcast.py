"""`weight_sync: broadcast` (queue/weights_broadcast.py, issue 31 ask 3): the learner's tensors to the
workers in one collective broadcast over a process group of their own (gloo here, NCCL on GPUs; the
code is the same but for the backend). Real TCPStores and gloo groups over TCP; receivers in threads
of this process and in a worker process of their own (killed to end the group). End to end: the
tiny run with weight_sync=broadcast (tests/trainer/job/test_run_e2e.py), whose worker exits 0 after
the learner's goodbye."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from eopd_trainer.queue.weights import WeightsUnavailable, load_tensors
from eopd_trainer.queue.weights_broadcast import (
    BroadcastReceiver,
    BroadcastSender,
    Endpoint,
    endpoint_of,
    indexed,
    split_address,
)
from tests.trainer.queue.test_weights_buffer import Small


KEY = b"k" * 64  # the run's message key (queue.auth_key_file)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32))
    return model


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def told(endpoint: Endpoint, state: str) -> None:
    """A receiver that joins now is told `state` (full, closed) and loads files."""
    late = BroadcastReceiver(endpoint).start()
    try:
        wait_for(lambda: late.state == state, what=f"a late receiver to be told {state}")
    finally:
        late.close()


def test_every_version_reaches_every_worker_whole_and_in_another_dtype():
    endpoint = Endpoint(address=free_address(), workers=2, join_timeout_s=30, timeout_s=30, key=KEY)
    learner = Small(torch.bfloat16)
    sender = BroadcastSender(endpoint, learner)
    receivers = [BroadcastReceiver(endpoint).start() for _ in range(2)]
    try:
        for version in (1, 2, 3):
            randomised(learner, version)
            pv = sender.publish(learner, version=version, iteration=version)
            assert (pv.format, pv.version, pv.sha256, pv.uri) == ("broadcast", version, f"seq:{version}",
                                                                  f"broadcast://{endpoint.address}")
            for r in receivers:
                wait_for(lambda r=r: r.received == version, what=f"version {version}")
                worker = Small(torch.float32)
                with r.holding(pv) as tensors:
                    assert set(tensors) == {"embed.weight", "body.weight", "body.bias", "scale"}  # tied alias once
                    load_tensors(worker, tensors, pv.uri)
                for name, t in learner.state_dict().items():
                    assert torch.equal(worker.state_dict()[name], t.float()), name
        assert sorted(r.rank for r in receivers) == [1, 2]
        # an announcement the receiver does not hold (older, or with another sequence) is refused
        stale = pv.__class__(**{**pv.__dict__, "version": 2, "sha256": "seq:2"})
        with pytest.raises(WeightsUnavailable, match="holds sequence 3"):
            with receivers[0].holding(stale):
                pass
        with pytest.raises(WeightsUnavailable, match="names no sequence"):
            with receivers[0].holding(pv.__class__(**{**pv.__dict__, "sha256": "abc"})):
                pass
        # the run is over: the goodbye ends every receiver's thread (none is left blocked in gloo's
        # wait when a worker exits), and the last version stays loadable
        sender.finish()
        for r in receivers:
            wait_for(lambda r=r: not r._thread.is_alive(), what="the receiver's thread to end")
            assert (r.state, r.received) == ("ended", 3)
            with r.holding(pv) as tensors:
                assert torch.equal(tensors["scale"].float(), learner.state_dict()["scale"].float())
        told(endpoint, "closed")
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_an_announcement_waits_for_the_receiver_still_checking_it(monkeypatch):
    """The learner announces once its broadcast has gone out; the receiver's thread may still be
    checking it (or waiting for the GIL). `holding` waits for it (a worker's `gc.collect()` beside
    the receive made the tiny broadcast run log "cannot load the announced weights" once), and an
    announcement not held by then is refused as before."""
    import eopd_trainer.queue.weights_broadcast as wb

    slow = threading.Event()
    real = wb.checksum

    def slow_checksum(t):
        if slow.is_set():
            time.sleep(0.5)
        return real(t)

    monkeypatch.setattr(wb, "checksum", slow_checksum)
    endpoint = Endpoint(address=free_address(), workers=1, join_timeout_s=30, timeout_s=30, key=KEY)
    learner = Small(torch.float32)
    sender = BroadcastSender(endpoint, learner)
    receiver = BroadcastReceiver(endpoint).start()
    try:
        sender.publish(randomised(learner, 1), version=1, iteration=1)
        wait_for(lambda: receiver.received == 1, what="version 1")
        slow.set()
        pv = sender.publish(randomised(learner, 2), version=2, iteration=2)
        with pytest.raises(WeightsUnavailable, match="holds sequence 1"):
            with receiver.holding(pv, arrival_wait_s=0.0):
                pass
        with receiver.holding(pv) as tensors:  # waits for the check and the swap
            assert torch.equal(tensors["scale"], learner.state_dict()["scale"])
        assert receiver.received == 2
    finally:
        slow.clear()
        sender.finish()
        receiver.close()
        sender.close()


def test_a_receiver_past_the_group_size_is_told_full():
    endpoint = Endpoint(address=free_address(), workers=1, join_timeout_s=30, timeout_s=30, key=KEY)
    learner = randomised(Small(), 0)
    sender = BroadcastSender(endpoint, learner)
    first = BroadcastReceiver(endpoint).start()
    try:
        assert sender.publish(learner, 0, 0) is not None
        wait_for(lambda: first.received == 1, what="the first receiver")
        told(endpoint, "full")
    finally:
        first.close()
        sender.close()


WORKER = textwrap.dedent("""
    import sys, time, torch
    from eopd_trainer.queue.weights_broadcast import BroadcastReceiver, Endpoint
    r = BroadcastReceiver(Endpoint(address=sys.argv[1], workers=1, join_timeout_s=30, timeout_s=5,
                                   key=sys.argv[2].encode())).start()
    while r.received == 0:
        time.sleep(0.02)
    print("received", r.ready_header[2], flush=True)
    time.sleep(600)
""")


def test_a_dead_worker_ends_the_group_and_the_learner_falls_back():
    """A worker process receives version 0 and is killed; the next publish fails within its timeout,
    returns None (the caller publishes files) and closes the group; a later receiver is told so."""
    endpoint = Endpoint(address=free_address(), workers=1, join_timeout_s=30, timeout_s=5, key=KEY)
    learner = randomised(Small(), 0)
    sender = BroadcastSender(endpoint, learner)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, endpoint.address, KEY.decode()], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert sender.publish(learner, 0, 0) is not None
        assert worker.stdout.readline().split() == ["received", "0"]
        worker.kill()
        worker.wait(10)
        t0 = time.monotonic()
        assert sender.publish(randomised(learner, 1), 1, 1) is None
        assert time.monotonic() - t0 < 30
        assert sender.failed and sender.publish(learner, 2, 2) is None  # files from now on
        told(endpoint, "closed")
    finally:
        worker.kill()
        sender.close()


def test_a_restarted_learner_forms_a_new_group_that_the_receivers_join():
    address = free_address()
    endpoint = Endpoint(address=address, workers=1, join_timeout_s=30, timeout_s=10, key=KEY)
    learner = randomised(Small(), 0)
    sender = BroadcastSender(endpoint, learner)
    receiver = BroadcastReceiver(endpoint).start()
    try:
        pv = sender.publish(learner, 4, 4)
        wait_for(lambda: receiver.received == 1, what="version 4")
        sender.close()
        del sender  # the learner process is gone: its store and group with it
        restarted = BroadcastSender(endpoint, randomised(learner, 5))
        pv = restarted.publish(learner, 5, 5)
        assert pv is not None and pv.sha256 == "seq:1"  # a new group counts from 1 again
        wait_for(lambda: receiver.ready_header is not None and receiver.ready_header[2] == 5, what="version 5")
        with receiver.holding(pv) as tensors:
            assert torch.equal(tensors["body.weight"], learner.body.weight)
        restarted.close()
    finally:
        receiver.close()


def test_endpoints_are_checked():
    with pytest.raises(ValueError, match="weight_broadcast.address"):
        split_address("no-port")
    with pytest.raises(ValueError, match="weight_broadcast.address"):
        split_address("host:99999")

    class Section:
        address, workers, backend, join_timeout_s, timeout_s = "", 1, "auto", 1.0, 1.0

    with pytest.raises(ValueError, match="empty"):
        endpoint_of(Section(), None)


def test_nccl_where_it_cannot_run_falls_back_to_files_and_takes_no_rank():
    """backend=nccl with CPU weights and a torch without NCCL (this machine): the learner's first
    publish falls back to files at once, and a CPU worker does not take a rank in an NCCL group."""
    endpoint = Endpoint(address=free_address(), workers=1, backend="nccl", join_timeout_s=30, timeout_s=5, key=KEY)
    learner = randomised(Small(), 0)
    sender = BroadcastSender(endpoint, learner)
    receiver = BroadcastReceiver(endpoint).start()
    try:
        wait_for(lambda: receiver.state.startswith("unusable: the learner broadcasts over NCCL"), what="the refusal")
        assert sender.store.add(sender.session.key("claims"), 0) == 0  # no rank claimed
        assert sender.publish(learner, 0, 0) is None and "NCCL" in sender.failed
    finally:
        receiver.close()
        sender.close()


def test_indexed_device_names_the_current_cuda_device():
    """A worker configured with student.device=cuda receives on its current CUDA device: NCCL and
    torch.cuda.set_device need the index (the receiver raised on "cuda" on the first GPU run)."""
    assert indexed("cuda", current=lambda: 3) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda", 1), current=lambda: 3) == torch.device("cuda", 1)
    assert indexed("cpu", current=lambda: 3) == torch.device("cpu")
