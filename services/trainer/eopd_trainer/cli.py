"""`eopd`: one command for the pipeline's processes, the whole job on one machine, its evaluation and report.

    eopd train   --config FILE [key=value ...]     the learner (same as eopd-train)
    eopd rollout --config FILE [--worker-id ID] [key=value ...]   a rollout worker (eopd-rollout)
    eopd config  --config FILE [key=value ...]     validate and print the effective config
    eopd run     --config FILE [key=value ...] [--validate-only] [--no-eval] [--resume | --overwrite]
                                                   the whole job on one machine (--resume: continue run_dir)
    eopd prepare --config FILE [key=value ...] [--overwrite]   materialise the run directory (student, data, run.yaml)
    eopd eval    --run-dir DIR [--model final|initial|teacher|SPEC ...]        Avg@k, Pass@k, entropies, KL
    eopd report  RUN_DIR [RUN_DIR ...] [--out FILE.html]                       HTML report with figures
    eopd bench   all|gpu|e2e|projection [--quick] [--require-all] [--only NAME ...]   benchmarks (from a checkout:
                                                   runs `python -m bench.run_all` in the repository root)
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from eopd_common.memory import return_large_frees

from .config import ConfigError, dump_config, load_config

# The checkout this package is installed from (editable installs): <root>/services/trainer/eopd_trainer/cli.py
REPO_ROOT = Path(__file__).resolve().parents[3]


def _config(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="eopd config", description="Validate a run config and print it with defaults.")
    p.add_argument("--config", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        print(dump_config(load_config(args.config, args.overrides)), end="")
    except ConfigError as exc:
        print(f"eopd config: {exc}", file=sys.stderr)
        return 2
    return 0


def _bench(argv: list[str]) -> int:
    """Runs `python -m bench.run_all ARGS` in the checkout this package is installed from: the
    benchmarks are the repository's bench/, never part of the installed package (nor imported by it)."""
    if not (REPO_ROOT / "bench" / "run_all.py").is_file():
        print(f"eopd bench: no bench/run_all.py in {REPO_ROOT}: the benchmarks live in the repository's bench/; "
              "install eopd editable from a checkout (scripts/bootstrap.sh) and run `eopd bench` or, in its root, "
              "`python -m bench.run_all`", file=sys.stderr)
        return 2
    with subprocess.Popen([sys.executable, "-m", "bench.run_all", *argv], cwd=REPO_ROOT) as proc:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C (same process group): let it finish
            return proc.wait()


# command -> "module:function" (imported only when the command runs) or a function of this module
COMMANDS: dict[str, str | Callable[[list[str]], int]] = {
    "train": "eopd_trainer.learner.cli:main",
    "rollout": "eopd_trainer.rollout.cli:main",
    "config": _config,
    "run": "eopd_trainer.job.run:main",
    "prepare": "eopd_trainer.job.prepare:main",
    "eval": "eopd_trainer.eval.evaluate:main",
    "report": "eopd_trainer.eval.report:main",
    "bench": _bench,
}


def resolve(command: str) -> Callable[[list[str]], int]:
    target = COMMANDS[command]
    if callable(target):
        return target
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return_large_frees()  # eopd_common.memory: a freed model or batch goes back to the system
    return resolve(argv[0])(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
