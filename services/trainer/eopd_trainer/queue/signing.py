"""End-to-end authentication of the queue's messages: an HMAC-SHA256 over each serialised entry
with a per-run key that the learner and the rollout workers hold and Redis does not.

Whoever can write to Redis (a local process when the Redis has no password, anyone holding the
Redis password of a shared deployment) can add entries and overwrite keys, but without the key
cannot make an entry that the learner or a worker accepts: an entry whose MAC is missing or wrong is
dead-lettered with the reason `unauthenticated` before any decoder sees it (`StreamQueue`), and an
announcement whose MAC is wrong is ignored (`queue/announce.py`).

What is authenticated, and how:

- stream entries (`<ns>:tasks`, `<ns>:rollouts`): a second field `mac` beside `data`, the
  HMAC-SHA256 of `scope NUL data` where scope is the stream's key (namespace included), so an entry
  cannot be moved to another stream or another run's namespace;
- the policy announcement (`<ns>:policy`, a string key): the value is `MAGIC + mac + payload`, scope
  the key's name.

A copy of a genuine entry (a replay) still verifies: the learner's ledger drops a rollout id it has
already trained as a duplicate, a worker's task is keyed by its task id. Pure: no Redis, no files
except `load_key` / `write_key_file` at the edge.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

MIN_KEY_BYTES = 32
MAC_FIELD = b"mac"
DATA_FIELD = b"data"
MAGIC = b"eopd-hmac1:"  # prefix of a sealed string value (the policy announcement)
UNAUTHENTICATED = "unauthenticated"  # the dead-letter reason and the `<ns>:counts` field


class Unauthenticated(ValueError):
    """A message without a valid MAC under the run's key."""


class Signer:
    """Signs and verifies queue messages with one key; `Signer(None)` is the unauthenticated mode
    (no key configured): nothing is signed and everything passes, as before authentication existed."""

    def __init__(self, key: bytes | None):
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the queue's message key has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
        self._key = key

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def mac(self, scope: str, payload: bytes) -> bytes:
        if self._key is None:
            raise RuntimeError("no key: the queue runs unauthenticated")
        h = hmac.new(self._key, scope.encode() + b"\0", hashlib.sha256)
        h.update(payload)  # not concatenated: no copy of a large payload
        return h.digest()

    def valid(self, scope: str, payload: bytes | None, mac: bytes | None) -> bool:
        """True when `mac` authenticates `payload` in `scope` (always, in the unauthenticated mode)."""
        if self._key is None:
            return True
        if payload is None or mac is None:
            return False
        return hmac.compare_digest(self.mac(scope, payload), mac)

    def fields(self, scope: str, payload: bytes) -> dict[bytes, bytes]:
        """The fields of a stream entry carrying `payload` (plus its MAC when a key is set)."""
        if self._key is None:
            return {DATA_FIELD: payload}
        return {DATA_FIELD: payload, MAC_FIELD: self.mac(scope, payload)}

    def seal(self, scope: str, payload: bytes) -> bytes:
        """One string value carrying `payload` and its MAC (`payload` itself without a key)."""
        if self._key is None:
            return payload
        return MAGIC + self.mac(scope, payload) + payload

    def unseal(self, scope: str, value: bytes) -> bytes:
        """The payload of a `seal`ed value; raises Unauthenticated when the MAC is missing or wrong
        (or, without a key, when the value is sealed: the writer has a key this process lacks)."""
        if self._key is None:
            if value.startswith(MAGIC):
                raise Unauthenticated(f"{scope}: sealed with a key and this process has none (set queue.auth_key_file)")
            return value
        n = len(MAGIC) + hashlib.sha256().digest_size
        if len(value) < n or not value.startswith(MAGIC):
            raise Unauthenticated(f"{scope}: no MAC")
        mac, payload = value[len(MAGIC):n], value[n:]
        if not hmac.compare_digest(self.mac(scope, payload), mac):
            raise Unauthenticated(f"{scope}: wrong MAC")
        return payload


def load_key(path: str | Path) -> bytes:
    """The key in `path`: the file's content without surrounding whitespace (e.g. 64 hex characters
    from `openssl rand -hex 32`, a Kubernetes or compose secret), at least MIN_KEY_BYTES bytes."""
    p = Path(path)
    try:
        key = p.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"queue.auth_key_file {p}: cannot read it ({exc.strerror})") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"queue.auth_key_file {p}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed "
                         "(e.g. `openssl rand -hex 32`)")
    return key


def signer_for(auth_key_file: str | None) -> Signer:
    """The signer of a process whose config names `auth_key_file` (None: unauthenticated)."""
    return Signer(load_key(auth_key_file) if auth_key_file else None)


def write_key_file(path: str | Path) -> Path:
    """A new random key (64 hex characters) in `path`, created 0600 (never readable by others, not even
    for a moment); an existing file is kept as it is (a resumed run keeps its key)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        load_key(p)  # must be usable
        return p
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(MIN_KEY_BYTES) + "\n")
    return p
