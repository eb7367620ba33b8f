"""Weight sync by a collective broadcast (`weight_sync: broadcast`, issue 31 ask 3): the learner
(rank 0) and the rollout workers (ranks 1..W) form a torch.distributed process group of their own,
NCCL between GPUs (one node or several), gloo between CPUs, and each published version goes from
the learner to every worker in one `broadcast`, device to device: no file, no shared memory, no
host copy on a GPU. The group is separate from the learner's DeepSpeed group (its own TCPStore,
hosted by the learner at `weight_broadcast.address`; verl, slime and NeMo-RL build theirs the same
way).

What is sent is the mapped buffer's data region (queue/weights_buffer.py's layout: every tensor
`export_state_dict` keeps, in the learner's dtypes, at 64-byte aligned offsets; the layout's JSON
goes through the store once), preceded by a header: a magic number, a sequence number (+1 per
broadcast), the version, the iteration, the payload's checksum and size, and the layout's hash.

A worker's receiver thread is always waiting in the next broadcast, so the learner's broadcast does
not wait for the worker's sampling to finish (NCCL: the receive runs on its own stream). It receives
into a staging buffer, checks the checksum, and swaps staging and ready under a lock; the worker
loads the ready buffer under the same lock (`BroadcastReceiver.holding`), so it never reads a buffer
being received into. The learner announces a version (`PolicyVersion`, format `broadcast`, `sha256` =
"seq:<n>") only after its broadcast has returned, and a worker loads it only when its ready buffer
holds that sequence number (else `WeightsUnavailable`: retried, as with every other path).

Where it listens (issue 49): the store on the address's host only (`eopd run`: 127.0.0.1; a
deployment: the learner's address; TCPStore alone binds every interface, so it is handed a socket
bound there, queue/store_listen.py), gloo's sockets on the same host on the learner and, on a
worker, on the address it reaches the learner from (the loopback on one node).

Who may join (queue/broadcast_trust.py): only holders of the run's message key
(`queue.auth_key_file`; without one there is no broadcast, files). Everything in the store is sealed
under a key derived from it, in a session the learner opens (a random id); ranks are granted by the
learner to workers' sealed claims (a replayed claim gets no second rank), and once the group has
formed every rank proves the key over the group's own connections before the first byte of weights.
Anything that does not verify (a stranger wrote into the session, deleted a key, answered on a
socket) makes the store untrusted: the learner falls back to files at its next check (every 0.1 s
while it admits), a worker loads files. The group forms within FORM_S (20 s) of the last grant;
only the wait for the workers' claims (they load their models first) may take `join_timeout_s`.

Membership is fixed for the learner's life: W workers. A broadcast that fails (a worker died, a
timeout) ends the group: the learner logs it, closes the group (sealed `state` = closed) and
publishes every later version as files (`weight_sync: disk`, the fallback), which every worker
loads. A worker that finds the group full or closed loads files only. A restarted learner hosts a
new store and session, and the workers' receivers join it again.

A learner that finished its run says goodbye (`BroadcastSender.finish`): one last header with
sequence number 0, after which each receiver's thread leaves the group and ends, so that no thread
is blocked in gloo's or NCCL's wait when the worker's process exits.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .broadcast_trust import (
    CLOSED,
    OPEN,
    GroupStore,
    NotAdmitted,
    Untrusted,
    admit,
    broadcast_signer,
    claim_rank,
    handshake,
    new_session,
    open_session,
)
from .messages import PolicyVersion, now_ns
from .signing import load_key
from .store_listen import gloo_options, is_loopback, local_address_towards, server_store
from .weights import WeightsUnavailable
from .weights_buffer import Entry, buffer_end, checksum, data_start, layout_of, parse_layout, tensor_views

log = logging.getLogger("eopd.weights")

FORMAT = "broadcast"
MAGIC = 0x454F5044_42433031  # "EOPDBC01"
HEADER_LEN = 8  # magic, seq, version, iteration, checksum, payload bytes, layout hash (2 x int64)
GOODBYE = 0  # the sequence number of the learner's last header: the run is over
REJOIN_S = 2.0  # a receiver whose group ended tries to join a new one this often
ARRIVAL_WAIT_S = 5.0  # an announced version still being checked and swapped in by the receiver's thread: waited for this long
FORM_S = 20.0  # once every worker is admitted: the group forms (and proves the key) within this, else files
NO_KEY = "no key (weight_sync broadcast needs queue.auth_key_file: eopd run makes one)"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"weight_broadcast.address: {address!r} is not host:port")
    return host, int(port)


def pick_backend(backend: str, device: torch.device) -> str:
    """`auto`: NCCL when the tensors live on a CUDA device, gloo otherwise."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def indexed(device: torch.device | str, current=None) -> torch.device:
    """`device` with its index: "cuda" names the process's current CUDA device, as `torch.cuda.set_device`
    and NCCL need (`torch.cuda.set_device(torch.device("cuda"))` raises: the rollout worker's
    receiver failed so on its first GPU run, student.device=cuda). `current()` gives that index
    (default `torch.cuda.current_device`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", (current or torch.cuda.current_device)())
    return device


def usable(backend: str) -> None:
    """RuntimeError when this process cannot take part in a `backend` group."""
    if backend == "nccl" and not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("weight_broadcast.backend=nccl: this torch has no NCCL")


def new_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float,
              host: str) -> dist.ProcessGroup:
    """A process group of its own over `store` (not the default group: the learner's DeepSpeed group
    is that), listening on `host` only (gloo's device; NCCL's sockets on the loopback when `host` is
    one, unless NCCL_SOCKET_IFNAME says otherwise). Blocks until every rank has joined (or `timeout_s`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, gloo_options(host, timeout_s))
    if backend == "nccl":
        usable(backend)
        if is_loopback(host):
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weight_broadcast.backend: {backend!r} is not gloo or nccl")


def _layout_hash(described: bytes) -> tuple[int, int]:
    digest = hashlib.sha256(described).digest()
    return int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:16], "little", signed=True)


def _payload_bytes(entries: list[Entry], described: bytes) -> tuple[int, int]:
    """(start of the data region, its bytes): as the mapped buffer lays it out."""
    start = data_start(len(described))
    return start, buffer_end(entries, len(described)) - start


@dataclass(frozen=True)
class Endpoint:
    """Where the group meets and how: the learner's store (`address`), W workers, the backend, and
    the run's message key (None: no broadcast, files; broadcast_trust.py)."""

    address: str
    workers: int
    backend: str = "auto"
    join_timeout_s: float = 600.0
    timeout_s: float = 300.0
    key: bytes | None = field(default=None, repr=False)


def endpoint_of(section, auth_key_file: str | None) -> Endpoint:
    """The Endpoint of a run config's `weight_broadcast` section (config/sections.py) and its
    `queue.auth_key_file` (the run's message key: who holds it may join the group)."""
    if not section.address:
        raise ValueError("weight_broadcast.address: empty (eopd run fills it in; a deployment names the learner's "
                         "host:port)")
    split_address(section.address)
    return Endpoint(address=section.address, workers=section.workers, backend=section.backend,
                    join_timeout_s=section.join_timeout_s, timeout_s=section.timeout_s,
                    key=load_key(auth_key_file) if auth_key_file else None)


class BroadcastSender:
    """The learner's side (rank 0 of the learner): hosts the store on the address's host only, admits
    the workers and forms the group at the first publish (broadcast_trust.py), broadcasts every
    version; `failed` (why) once the group could not form or a broadcast failed, after which
    `publish` returns None and the caller publishes files."""

    def __init__(self, endpoint: Endpoint, model: torch.nn.Module):
        self.endpoint = endpoint
        self.entries, _, self.described = layout_of(model)
        self.start, self.nbytes = _payload_bytes(self.entries, self.described)
        device = next(model.parameters()).device
        self.backend = pick_backend(endpoint.backend, device)
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.host, port = split_address(endpoint.address)
        self.group: dist.ProcessGroup | None = None
        self.payload = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views = tensor_views(self.payload, self.entries, self.start)  # each tensor's place in the payload
        self.seq = 0
        self.failed: str | None = None
        self.session: GroupStore | None = None
        if endpoint.key is None:  # nobody could be told apart from a stranger: no store at all
            self._fail(NO_KEY)
            return
        self.signer = broadcast_signer(endpoint.key)
        try:
            self.store = server_store(self.host, port, FORM_S)
        except OSError as exc:  # the port was taken meanwhile, an address not of this machine
            self._fail(f"cannot listen on {endpoint.address}: {exc}")
            return
        self.session, self._written = new_session(GroupStore(self.store, self.signer), {
            "layout": self.described, "backend": self.backend, "size": str(endpoint.workers + 1)})

    def _form(self) -> dist.ProcessGroup:
        """Admits the W workers (the store checked every poll), forms the group within FORM_S and
        runs the handshake over it; Untrusted, TimeoutError or a backend's error otherwise."""
        size = self.endpoint.workers + 1
        usable(self.backend)  # before any worker is admitted: no wait for a group that cannot form
        admit(self.session, self.endpoint.workers, self._written, time.monotonic() + self.endpoint.join_timeout_s)
        group = new_group(self.session.under("group"), 0, size, self.backend, FORM_S, self.host)
        handshake(group, 0, size, self.signer, self.session.session, self.device)
        return group

    def publish(self, model: torch.nn.Module, version: int, iteration: int) -> PolicyVersion | None:
        """Broadcasts the model's tensors as `version`; the announcement, or None when the group has
        failed (now or before: the caller falls back to files)."""
        if self.failed is not None:
            return None
        t0 = time.monotonic()
        try:
            if self.group is None:
                self.group = self._form()
                log.info("weight broadcast group formed (%s, %d workers) in %.1fs", self.backend,
                         self.endpoint.workers, time.monotonic() - t0)
            state = model.state_dict()
            with torch.no_grad():
                for name, view in self.views.items():
                    view.copy_(state[name].detach())
            self.seq += 1
            header = torch.tensor([MAGIC, self.seq, version, iteration, checksum(self.payload), self.nbytes,
                                   *_layout_hash(self.described)], dtype=torch.int64, device=self.device)
            timeout = datetime.timedelta(seconds=self.endpoint.timeout_s)
            self.group.broadcast(header, 0, timeout).wait()
            self.group.broadcast(self.payload, 0, timeout).wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # any failure ends the group: the rest of the run goes through files
            self._fail(f"{type(exc).__name__}: {exc}")
            return None
        return PolicyVersion(version=version, uri=f"broadcast://{self.endpoint.address}", sha256=f"seq:{self.seq}",
                             num_bytes=self.nbytes, iteration=iteration, created_unix_ns=now_ns(), format=FORMAT)

    def _fail(self, why: str) -> None:
        self.failed = why
        log.warning("weight broadcast failed (%s); publishing files from now on (weight_sync disk)", why)
        self.close()

    def finish(self) -> None:
        """The run is over: a goodbye header (sequence number 0) ends every receiver's thread, then
        the group closes. Best effort: a receiver that misses it ends with its process."""
        if self.group is not None:
            header = torch.tensor([MAGIC, GOODBYE, -1, -1, 0, self.nbytes, *_layout_hash(self.described)],
                                  dtype=torch.int64, device=self.device)
            try:
                self.group.broadcast(header, 0, datetime.timedelta(seconds=self.endpoint.timeout_s)).wait()
            except Exception as exc:  # a worker already gone: nothing to end there
                log.info("weight broadcast: goodbye not delivered (%s: %s)", type(exc).__name__, exc)
        self.close()

    def close(self) -> None:
        if self.session is not None:
            with contextlib.suppress(Exception):
                self.session.put("state", CLOSED)
        self.group = None


class BroadcastReceiver:
    """A worker's side: a thread that joins the group and receives every broadcast; `holding(pv)`
    gives the announced version's tensors (views into the ready buffer, valid inside the block)."""

    def __init__(self, endpoint: Endpoint, device: torch.device | str = "cpu"):
        self.endpoint = endpoint
        self.device = indexed(device)
        self.signer = broadcast_signer(endpoint.key) if endpoint.key is not None else None
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)  # notified when a version is ready
        self.stop = threading.Event()
        self.ready: torch.Tensor | None = None
        self.ready_header: list[int] | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.state = "joining"  # joining, joined, full, closed, untrusted: <why>, unusable: <why>, failed: <why>
        self.rank = 0
        self.received = 0
        self._thread = threading.Thread(target=self._run, name="weight-broadcast", daemon=True)

    def start(self) -> BroadcastReceiver:
        self._thread.start()
        return self

    def close(self, wait_s: float = 1.0) -> None:
        """Stops the thread; waits up to `wait_s` for it (it ends at once unless blocked in a
        broadcast: the learner's goodbye ends that one)."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(wait_s)

    @contextlib.contextmanager
    def holding(self, pv: PolicyVersion, arrival_wait_s: float = ARRIVAL_WAIT_S) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors of `pv` (views into the ready buffer; loading copies them out), the lock held
        so that no receive swaps them meanwhile; WeightsUnavailable unless the ready buffer holds the
        announced sequence number and version."""
        want = pv.sha256[4:] if pv.sha256.startswith("seq:") else ""
        if not want.isdigit():
            raise WeightsUnavailable(f"weight broadcast (version {pv.version}): announcement {pv.sha256!r} names no "
                                     "sequence number")
        seq = int(want)
        with self.lock:
            # The learner announces once its broadcast has gone out; this thread may still be
            # checking and swapping it in (or waiting for the GIL): a joined receiver gets
            # `arrival_wait_s` to finish before the announcement counts as missed.
            if self.state == "joined":
                self.arrived.wait_for(lambda: self._holds_or_passed(seq), timeout=arrival_wait_s)
            header = self.ready_header
            if header is None or header[1] != seq or header[2] != pv.version:
                held = "nothing" if header is None else f"sequence {header[1]} (version {header[2]})"
                raise WeightsUnavailable(f"weight broadcast: this worker holds {held}, the announcement names sequence "
                                         f"{want} (version {pv.version}) (receiver {self.state})")
            yield self.views

    def _holds_or_passed(self, seq: int) -> bool:
        """(lock held) The ready buffer holds sequence `seq` or a later one, or the thread left the group."""
        return (self.ready_header is not None and self.ready_header[1] >= seq) or self.state != "joined"

    def _run(self) -> None:
        while not self.stop.is_set():
            before = self.state
            try:
                self._join_and_receive()
            except _GroupEnded as exc:
                self.state = str(exc)
                if self.state != before:  # polled every REJOIN_S: said once
                    log.info("weight broadcast: group %s; this worker loads the announced files", self.state)
            except Exception as exc:  # the learner went away, a timeout: join the next group it forms
                self.state = f"failed: {type(exc).__name__}: {exc}"
                if self.state != before:
                    log.warning("weight broadcast receiver: %s; rejoining", self.state)
            self.stop.wait(REJOIN_S)

    def _admitted(self, store: dist.Store) -> tuple[GroupStore, int, int, str, bytes] | None:
        """(the session, this worker's rank, the group's size, backend, layout), every value verified
        under the run's key; None while the learner has not opened a session yet; _GroupEnded when
        the group takes this worker no more, or the store cannot be trusted."""
        root = GroupStore(store, self.signer)
        if not root.has("session"):
            return None
        try:
            session = open_session(root)
            state = session.text("state")
            if state != OPEN:
                raise _GroupEnded(state)  # full, closed
            size, backend = int(session.text("size")), session.text("backend")
            if backend == "nccl" and self.device.type != "cuda":  # no rank claimed: the learner falls back to files
                raise _GroupEnded(f"unusable: the learner broadcasts over NCCL, this worker's device is {self.device}")
            described = session.read("layout")
            rank = claim_rank(session, time.monotonic() + self.endpoint.join_timeout_s, self.stop.is_set)
        except NotAdmitted as exc:
            raise _GroupEnded(str(exc)) from None
        except Untrusted as exc:
            raise _GroupEnded(f"untrusted: {exc}") from None
        return session, rank, size, backend, described

    def _join_and_receive(self) -> None:
        if self.signer is None:
            raise _GroupEnded(f"unusable: {NO_KEY}")
        host, port = split_address(self.endpoint.address)
        try:  # a plain connect first: TCPStore's own retries back off for up to FORM_S
            socket.create_connection((host, port), timeout=FORM_S).close()
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=FORM_S))
        except (OSError, dist.DistNetworkError):  # the learner has not opened its store (yet): files meanwhile
            raise _GroupEnded("not open yet (no store at the learner's address)") from None
        admitted = self._admitted(store)
        if admitted is None:
            return  # the learner is starting: tried again in REJOIN_S
        session, rank, size, backend, described = admitted
        entries = parse_layout(described, "the learner's broadcast layout")
        start, nbytes = _payload_bytes(entries, described)
        device = self.device if backend == "nccl" else torch.device("cpu")
        if backend == "nccl" and device.type == "cuda":
            torch.cuda.set_device(device)
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        group = new_group(session.under("group"), rank, size, backend, FORM_S, local_address_towards(host, port))
        try:
            handshake(group, rank, size, self.signer, session.session, device)
        except Untrusted as exc:
            raise _GroupEnded(f"untrusted: {exc}") from None
        self.rank, self.state = rank, "joined"
        expect = [MAGIC, *_layout_hash(described)]
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        staging = buffers[0]
        while not self.stop.is_set():
            # no timeout on the wait for the next version: the learner publishes when it has trained
            group.broadcast(header, 0, datetime.timedelta(days=7)).wait()
            got = [int(x) for x in header.tolist()]
            if [got[0], got[6], got[7]] != expect or got[5] != nbytes:
                raise RuntimeError(f"weight broadcast: header {got[:6]} is not this group's")
            if got[1] == GOODBYE:  # the learner finished its run: this thread ends
                self.state = "ended"
                self.stop.set()
                log.info("weight broadcast: the learner finished its run; receiver ended")
                return
            group.broadcast(staging, 0, datetime.timedelta(seconds=self.endpoint.timeout_s)).wait()
            if checksum(staging) != got[4]:
                raise RuntimeError(f"weight broadcast: version {got[2]} arrived with another checksum")
            with self.lock:
                staging, self.ready = (self.ready if self.ready is not None else buffers[1]), staging
                self.ready_header = got
                self.views = tensor_views(self.ready, entries, start)
                self.received += 1
                self.arrived.notify_all()


class _GroupEnded(Exception):
    """The group this worker could join is full, closed or unusable here: it loads files."""
