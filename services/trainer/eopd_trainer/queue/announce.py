"""The policy announcement: `<ns>:policy` holds the latest PolicyVersion (version, uri, sha256,
size) of the weight files (`queue/weights.py`); the learner SETs it, the workers poll it. Redis and
the messages only, no torch."""

from __future__ import annotations

from .messages import PolicyVersion, decode_policy, encode_policy


def announce(client, key: str, pv: PolicyVersion) -> None:
    client.set(key, encode_policy(pv))


def current_announcement(client, key: str) -> PolicyVersion | None:
    raw = client.get(key)
    return decode_policy(raw) if raw else None
