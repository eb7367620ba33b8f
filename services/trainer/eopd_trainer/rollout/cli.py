"""`eopd-rollout` (and `python -m eopd_trainer.rollout`): one rollout worker.

    eopd-rollout --config configs/tiny.yaml [--worker-id w0] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

from eopd_common.memory import return_large_frees

from ..config import ConfigError, config_for_process
from .samplers.base import SamplerUnavailable
from .teacher_checks import TeacherIncompatible, TokenizerMismatch
from .teacher_wait import TeacherRefused
from .worker import RolloutWorker

EXIT_TOKENIZER_MISMATCH = 3


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eopd-rollout", description="EOPD rollout worker: sample, score with the teacher, publish.")
    p.add_argument("--config", type=str, default=None, help="run config YAML")
    p.add_argument("--worker-id", default=None, help="consumer name (default: host-pid); reuse it to resume its pending tasks")
    p.add_argument("--prometheus-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted paths (e.g. teacher.target=host:50051)")
    return p


async def _serve(worker: RolloutWorker) -> int:
    """Runs the worker; SIGTERM and SIGINT ask it to stop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop.set)
    return await worker.run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return_large_frees()  # eopd_common.memory: a weight load's copy goes back to the system
    cfg = config_for_process("eopd-rollout", args.config, args.overrides, "rollout")
    if cfg is None:
        return 2
    worker = RolloutWorker(cfg, args.worker_id or default_worker_id(), args.prometheus_port)
    try:
        worker.setup()
        return asyncio.run(_serve(worker))
    except TokenizerMismatch as exc:
        print(f"eopd-rollout: {exc}", file=sys.stderr)
        return EXIT_TOKENIZER_MISMATCH
    except SamplerUnavailable as exc:  # e.g. rollout.engine=vllm without vLLM installed
        print(f"eopd-rollout: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, TeacherRefused, TeacherIncompatible) as exc:
        print(f"eopd-rollout: {exc}", file=sys.stderr)
        return 2
    finally:
        receiver = getattr(worker, "receiver", None)
        if receiver is not None:
            receiver.close()
        sampler = getattr(worker, "sampler", None)
        if sampler is not None:
            sampler.close()


if __name__ == "__main__":
    sys.exit(main())
