"""`eopd-train` (and `python -m eopd_trainer.learner`, `torchrun -m eopd_trainer.learner`): the learner.

    eopd-train --config configs/tiny.yaml [key=value ...]
    torchrun --nproc-per-node 2 -m eopd_trainer.learner --config ... train.zero_stage=2
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from eopd_common.memory import return_large_frees

from ..config import config_for_process
from ..queue.lease import LeaseHeld
from .checkpoint import CheckpointError
from .feed import LearnerAbort
from .loop import LearnerLoop

log = logging.getLogger("eopd.learner")


def raised_outside_eopd(exc: BaseException) -> bool:
    """Whether the innermost frame of `exc`'s traceback is outside eopd's packages."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return "eopd_" not in Path(tb.tb_frame.f_code.co_filename).as_posix()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eopd-train", description="EOPD learner: DeepSpeed training on scored rollouts from Redis.")
    p.add_argument("--config", type=str, default=None, help="run config YAML")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted paths (e.g. train.lr=1e-5)")
    # The `deepspeed` launcher passes --local_rank; torchrun sets LOCAL_RANK. Both are read from env.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return_large_frees()  # eopd_common.memory: a step's activations and a checkpoint's copies go back
    cfg = config_for_process("eopd-train", args.config, args.overrides, "learner")
    if cfg is None:
        return 2
    learner = LearnerLoop(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, learner.request_stop)
    try:
        try:
            learner.setup()
        except (ValueError, LeaseHeld) as exc:
            # eopd's own refusals say what to change; one raised inside a library (DeepSpeed, torch)
            # keeps its traceback in the log: the message alone ("invalid literal for int() with base
            # 10: '0a'", the learner's first GPU run) does not say where it came from
            log.error("%s", exc, exc_info=raised_outside_eopd(exc))
            print(f"eopd-train: {exc}", file=sys.stderr, flush=True)
            return 2
        try:
            return learner.run()
        except CheckpointError as exc:
            log.error("%s", exc)
            print(f"eopd-train: {exc}", file=sys.stderr, flush=True)
            return 4
        except LearnerAbort as exc:
            log.error("%s", exc)
            print(f"eopd-train: {exc}", file=sys.stderr, flush=True)
            return exc.code
    finally:
        learner.close()


if __name__ == "__main__":
    sys.exit(main())
