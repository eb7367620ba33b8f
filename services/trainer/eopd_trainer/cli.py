"""`eopd`: one command for the pipeline's processes, the whole job on one machine, its evaluation and report.

    eopd train   --config FILE [key=value ...]     the learner (same as eopd-train)
    eopd rollout --config FILE [--worker-id ID] [key=value ...]   a rollout worker (eopd-rollout)
    eopd config  --config FILE [key=value ...]     validate and print the effective config
    eopd run     --config FILE [key=value ...] [--validate-only] [--no-eval] [--resume | --overwrite]
                                                   the whole job on one machine (--resume: continue run_dir)
    eopd prepare --config FILE [key=value ...] [--overwrite]   materialise the run directory (student, data, run.yaml)
    eopd eval    --run-dir DIR [--model final|initial|teacher|SPEC ...]        Avg@k, Pass@k, entropies, KL
    eopd report  RUN_DIR [RUN_DIR ...] [--out FILE.html]                       HTML report with figures
    eopd bench   all|projection [--quick] [--require-all] [--only NAME ...]     benchmarks (from a checkout)
"""

from __future__ import annotations

import sys

COMMANDS = ("train", "rollout", "config", "run", "prepare", "eval", "report", "bench")


def _config(argv: list[str]) -> int:
    import argparse

    from .config import ConfigError, dump_config, load_config

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from .learner.cli import main as train_main

        return train_main(rest)
    if cmd == "rollout":
        from .rollout.cli import main as rollout_main

        return rollout_main(rest)
    if cmd == "run":
        from .job.run import main as run_main

        return run_main(rest)
    if cmd == "prepare":
        from .job.prepare import main as prepare_main

        return prepare_main(rest)
    if cmd == "eval":
        from .eval.evaluate import main as eval_main

        return eval_main(rest)
    if cmd == "report":
        from .eval.report import main as report_main

        return report_main(rest)
    if cmd == "bench":
        return _bench(rest)
    return _config(rest)


def _bench(argv: list[str]) -> int:
    """Runs bench/run_all.py of the checkout this package is installed from (editable installs)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    if not (root / "bench" / "run_all.py").is_file():
        print("eopd bench: the benchmarks live in the repository's bench/; run this from an editable install", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from bench.run_all import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
