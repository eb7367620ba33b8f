"""Who may join the weight broadcast's group (issue 49 ask 1): only processes holding the run's key.

A TCPStore admits whoever connects and lets them read, list (`list_keys`), write and delete every
key, and gloo's rendezvous through it is unauthenticated. So nothing read from the store is trusted
unless the run's key vouches for it, and no weights go out before every rank has proved it holds
the key:

- the key: derived from the run's message key (`queue.auth_key_file`, `<run_dir>/queue.key` under
  `eopd run`, 0600; queue/signing.py), `broadcast_signer`, so no new secret to distribute;
- every value the learner or a worker writes is sealed (HMAC under that key, scoped by the key's
  name), `GroupStore`; a value that does not verify makes the store untrusted (`Untrusted`);
- ranks are handed out by the learner, not taken from a counter: a worker writes a sealed claim
  (a random nonce) into a numbered slot, the learner grants ranks 1..W to the first W distinct valid
  claims (sealed grants); a forged or moved claim makes the store untrusted, a replayed one (the
  same nonce) gets no second rank, a claim past W is told `full`;
- once gloo (or NCCL) has formed the group, `handshake` runs over the group's own connections:
  every rank contributes a random nonce, then a MAC of all of them under the key; every rank checks
  every other's. A stranger who rewrote gloo's addresses in the store, or reached a listening socket
  first, cannot answer: the group is dropped before a byte of the weights is sent.

What a stranger who can reach the store can still do is deny the broadcast (delete or overwrite
keys): the learner notices at its next check (every POLL_S while it admits) and falls back to files,
as after any failed broadcast; a worker that reads a value that does not verify loads files.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .signing import Signer, Unauthenticated

POLL_S = 0.1  # how often the learner looks for claims (and checks its own keys), a worker for its grant
MAX_CLAIMS = 64  # claim slots the learner reads before calling the store flooded
NONCE_BYTES = 16
MAC_BYTES = 32
OPEN, FULL, CLOSED = "open", "full", "closed"  # the group's `state`


class Untrusted(RuntimeError):
    """The store holds something the run's key does not vouch for, or a rank failed the handshake."""


def broadcast_signer(run_key: bytes) -> Signer:
    """The broadcast's own key, derived from the run's message key (never the same MACs as the queue's)."""
    return Signer(hmac.new(run_key, b"eopd weight broadcast v1", hashlib.sha256).hexdigest().encode())


@dataclass
class GroupStore:
    """Sealed values in a store: `put` writes one, `read` verifies it (Untrusted otherwise). `session`
    (the learner's random id for one group) prefixes every key but `session` itself."""

    store: dist.Store
    signer: Signer
    session: str = ""

    def key(self, name: str) -> str:
        return f"s/{self.session}/{name}" if self.session else name

    def put(self, name: str, value: str | bytes) -> None:
        key = self.key(name)
        raw = value.encode() if isinstance(value, str) else value
        self.store.set(key, self.signer.seal(key, raw))

    def has(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def read(self, name: str) -> bytes:
        return self.read_key(self.key(name))

    def read_key(self, key: str) -> bytes:
        """The verified value of a full key (Untrusted when it is missing or not the run's)."""
        if not self.store.check([key]):
            raise Untrusted(f"the store's {key!r} is gone: a process without the run's key deleted it")
        try:
            return self.signer.unseal(key, self.store.get(key))
        except Unauthenticated as exc:
            raise Untrusted(f"the store's {key!r} is not the run's ({exc}): a process without the run's key "
                            "wrote to it") from None

    def text(self, name: str) -> str:
        return self.read(name).decode()

    def under(self, name: str) -> dist.Store:
        """A plain store under this session's `name/` (gloo's rendezvous keys: the handshake vouches for them)."""
        return dist.PrefixStore(self.key(name), self.store)


def new_session(store: GroupStore, values: dict[str, str | bytes]) -> tuple[GroupStore, dict[str, bytes]]:
    """The learner's side: a new session id (sealed at the root), its values under it, state open.
    Returns the session's store and every value written (full key -> value: `Admission.expected`)."""
    session = secrets.token_hex(8)
    store.put("session", session)
    group = GroupStore(store.store, store.signer, session)
    written = {store.key("session"): session.encode()}
    for name, value in {**values, "state": OPEN}.items():
        group.put(name, value)
        written[group.key(name)] = value.encode() if isinstance(value, str) else value
    return group, written


def open_session(store: GroupStore) -> GroupStore:
    """A worker's side: the session the learner sealed at the root (Untrusted when it is not the run's)."""
    return GroupStore(store.store, store.signer, store.text("session"))


@dataclass
class Admission:
    """The learner's admission of W workers: `poll` reads the claims written since the last call and
    grants ranks; `done` once W are granted. Pure but for the store it is handed."""

    group: GroupStore
    workers: int
    expected: dict[str, bytes] = field(default_factory=dict)  # full key -> the learner's value, checked each poll
    granted: dict[str, int] = field(default_factory=dict)  # nonce -> rank
    pending: set[int] = field(default_factory=set)  # slots counted but not written yet
    seen: int = 0  # slots counted so far

    @property
    def done(self) -> bool:
        return len(self.granted) >= self.workers

    def poll(self) -> None:
        for key, value in self.expected.items():  # a stranger's overwrite or delete: untrusted
            if self.group.read_key(key) != value:
                raise Untrusted(f"the store's {key!r} changed under the learner")
        count = self.group.store.add(self.group.key("claims"), 0)
        if count > MAX_CLAIMS:
            raise Untrusted(f"{count} claims on the store's rank slots (at most {MAX_CLAIMS} are read): flooded")
        self.pending.update(range(self.seen + 1, count + 1))
        self.seen = max(self.seen, count)
        for slot in sorted(self.pending):
            if self.done:
                return
            if not self.group.has(f"claim/{slot}"):
                continue  # a worker between its count and its write, or a stranger's count: nothing taken
            self.pending.discard(slot)
            nonce = self.group.text(f"claim/{slot}")
            if nonce in self.granted:
                continue  # a replayed claim: no second rank
            self.granted[nonce] = len(self.granted) + 1
            self.group.put(f"grant/{nonce}", str(self.granted[nonce]))


def admit(group: GroupStore, workers: int, expected: dict[str, bytes], deadline: float,
          poll_s: float = POLL_S) -> None:
    """Blocks until W workers are granted ranks, then seals the group `full`; TimeoutError at
    `deadline` (monotonic), Untrusted when the store was tampered with."""
    admission = Admission(group, workers, expected)
    while True:
        admission.poll()
        if admission.done:
            group.put("state", FULL)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(admission.granted)} of {workers} workers joined the weight broadcast")
        time.sleep(poll_s)


class NotAdmitted(Exception):
    """The group takes this worker no more (`full`, `closed`): it loads files."""


def claim_rank(group: GroupStore, deadline: float, stopped: Callable[[], bool], poll_s: float = POLL_S) -> int:
    """A worker's side: claims a rank and waits for the learner's grant (NotAdmitted when the group
    is full or closed meanwhile, TimeoutError at `deadline`, Untrusted on a value that does not verify)."""
    nonce = secrets.token_hex(NONCE_BYTES)
    slot = group.store.add(group.key("claims"), 1)
    group.put(f"claim/{slot}", nonce)
    while not stopped():
        state = group.text("state")  # read first: the learner writes the last grant before `full`
        if group.has(f"grant/{nonce}"):
            return int(group.text(f"grant/{nonce}"))
        if state != OPEN:
            raise NotAdmitted(state)
        if time.monotonic() > deadline:
            raise TimeoutError("the learner granted this worker no rank in the weight broadcast")
        time.sleep(poll_s)
    raise NotAdmitted("stopped")


def handshake_macs(signer: Signer, session: str, nonces: list[bytes]) -> list[bytes]:
    """What each rank must send: the MAC of the session and every rank's nonce, scoped by its rank."""
    transcript = session.encode() + b"".join(nonces)
    return [signer.mac(f"handshake/{rank}", transcript) for rank in range(len(nonces))]


def _all_gather(group: dist.ProcessGroup, mine: bytes, size: int, device: torch.device) -> list[bytes]:
    inp = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    out = [torch.empty_like(inp) for _ in range(size)]
    group.allgather([out], [inp]).wait()
    return [bytes(t.cpu().tolist()) for t in out]


def handshake(group: dist.ProcessGroup, rank: int, size: int, signer: Signer, session: str,
              device: torch.device) -> None:
    """Every rank proves it holds the run's key over the group's own connections (see the module doc);
    Untrusted names the first rank that did not."""
    nonces = _all_gather(group, secrets.token_bytes(NONCE_BYTES), size, device)
    want = handshake_macs(signer, session, nonces)
    got = _all_gather(group, want[rank], size, device)
    for r, (w, g) in enumerate(zip(want, got, strict=True)):
        if not hmac.compare_digest(w, g):
            raise Untrusted(f"rank {r} of the weight broadcast's group did not prove the run's key")
