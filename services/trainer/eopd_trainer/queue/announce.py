"""The policy announcement: `<ns>:policy` holds the latest PolicyVersion (version, uri, sha256,
size) of the weight files (`queue/weights.py`); the learner SETs it, the workers poll it. Redis and
the messages only, no torch. With a message key the value is sealed (`signing.py`): an announcement
without a valid MAC (written by someone else than the learner) is ignored, as if none were there."""

from __future__ import annotations

import logging

from .messages import PolicyVersion, decode_policy, encode_policy
from .signing import Signer, Unauthenticated

log = logging.getLogger(__name__)
_last_ignored: bytes | None = None  # the last value ignored (logged once)


def announce(client, key: str, pv: PolicyVersion, signer: Signer | None = None) -> None:
    client.set(key, (signer or Signer(None)).seal(key, encode_policy(pv)))


def current_announcement(client, key: str, signer: Signer | None = None) -> PolicyVersion | None:
    """The announced PolicyVersion; None when nothing is announced or the announcement is not
    authentic (logged: someone other than the learner wrote `key`)."""
    raw = client.get(key)
    if not raw:
        return None
    try:
        payload = (signer or Signer(None)).unseal(key, raw)
    except Unauthenticated as exc:
        global _last_ignored
        if raw != _last_ignored:  # once per forged value: workers poll every rollout.weights_poll_s
            log.warning("ignoring the policy announcement: %s (not written by this run's learner)", exc)
            _last_ignored = raw
        return None
    return decode_policy(payload)
