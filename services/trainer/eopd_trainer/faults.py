"""Fault injection at named points (the tests and the chaos tier, docs/reliability.md).

Configured in the run config (`faults: [{point: learner.after_step, iteration: 2, step: 1}]`,
or as an override `faults=[{point: learner.after_commit, iteration: 1}]`). A fault fires when
its point matches and every field it sets (iteration, step, count) equals the context's.

Points: `learner.after_step` (an optimizer step of an iteration done, nothing committed),
`learner.after_commit` (checkpoint committed, entries not yet acknowledged),
`learner.before_commit`, `rollout.after_publish` (a rollout published, its task not yet
acknowledged; `count` = rollouts published by this process), `rollout.publish` (just before a
rollout is added to the stream; `count` = its number, the `count` its `rollout.after_publish`
will have), `rollout.after_sample`, `rollout.sample` (inside the sampling thread, before a batch
is sampled; `count` = rollouts published so far).

Actions: `kill` (SIGKILL to itself: no cleanup, exactly like an OOM kill or a lost node),
`hang` (sleep forever: a stalled process), `delay` (sleep `seconds`: a slow step), `raise` (an exception),
`corrupt` (`hit` returns True and the caller damages what it is about to send; at
`rollout.publish` the entry becomes undecodable, so the learner dead-letters it and the rollout
is lost: its iteration has to be completed by a replacement task).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


class Faults:
    def __init__(self, faults: Sequence = ()):
        self.faults = list(faults)

    def hit(self, point: str, **ctx: int) -> bool:
        """Fires the faults matching `point` and `ctx`; True if one of them was `corrupt` (for the caller to do)."""
        corrupt = False
        for f in self.faults:
            if f.point != point:
                continue
            wanted = {k: getattr(f, k) for k in ("iteration", "step", "count") if getattr(f, k) is not None}
            if any(ctx.get(k) != v for k, v in wanted.items()):
                continue
            msg = f"injected fault {f.action} at {point} {ctx}"
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)
            if f.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.action == "delay":
                time.sleep(f.seconds)
            elif f.action == "hang":
                while True:
                    time.sleep(3600)
            elif f.action == "corrupt":
                corrupt = True
            else:
                raise InjectedFault(msg)
        return corrupt


def corrupt_bytes(data: bytes) -> bytes:
    """A damaged copy of a serialized protobuf that no parser accepts: a leading 0xff byte is a
    field tag with wire type 7, which does not exist."""
    return b"\xff" + data
