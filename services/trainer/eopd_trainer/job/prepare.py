"""Preparing a run directory: what `eopd run` does before it starts any process, also as its own
command for deployments whose processes are started by someone else (Kubernetes, compose).

    eopd prepare --config configs/smollm2-cpu.yaml run_dir=/shared/runs/NAME [key=value ...] [--overwrite]

A run config may name things no process can load as they are: a layer-subset student
(`student.model: BASE[layers=START:STOP:STEP]`) and generated task data (`data.generate`). This
turns them into files in the run directory and writes the config the processes load:

    <run_dir>/student-init/          the layer-subset student (a Hugging Face directory)
    <run_dir>/teacher-init/          a layer-subset teacher (teacher.model = student.model: student-init/)
    <run_dir>/data/train.jsonl       the generator's splits (data.train_files / data.eval_files)
    <run_dir>/data/heldout.jsonl
    <run_dir>/run.yaml               the effective config: absolute paths, the materialised student

It prints the path of `run.yaml` as the last line of its output. The learner and the rollout workers then start with
`--config <run_dir>/run.yaml` (plus their own `key=value` overrides: teacher address, Redis URL).

Safe to run again and concurrently (one init container per pod on a shared volume): the work is
done under an exclusive lock on `<run_dir>/.prepare.lock`, the student is rebuilt only when its
selection changed, data files and run.yaml are replaced atomically (a process reading them sees
the old or the new file, never a partial one), and a run directory that already holds a trained
run is kept as it is (its checkpoints are what a restarted learner resumes from); `--overwrite`
deletes it first. `eopd run` refuses such a directory instead, unless `--resume` (resume.py) or
`--overwrite`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eopd_common.atomic_files import write_atomic
from eopd_common.models import materialise_spec, materialise_spec_apart, parse_layer_subset, resolve_spec

from ..config import ConfigError, RunConfig, dump_config, load_config
from ..config.teachers import teacher_key
from ..data import DataError, load_prompts
from ..teacher_context import teacher_prompt_texts
from ..problems.generator import write_splits

LOCK_NAME = ".prepare.lock"
CONFIG_NAME = "run.yaml"


def validate(cfg: RunConfig, *, local: bool = True, need_teacher: bool = True) -> list[str]:
    """Checks beyond the schema (no model is loaded). Returns problems.

    `local=False` (e.g. a GPU preset checked on another machine) checks the spec syntax only, not
    that model directories and prompt files exist here. `need_teacher=False` (`eopd prepare`: the
    teacher is someone else's service) does not require `teacher.model`."""
    problems = []
    if need_teacher and not cfg.teacher.model:
        problems.append("teacher.model: eopd run needs the model spec the teacher serves")
    for key, spec in (("teacher.model", cfg.teacher.model), ("student.model", cfg.student.model)):
        if not spec or (key == "teacher.model" and not need_teacher):
            continue
        try:
            parsed = parse_layer_subset(spec)
            if local:
                resolve_spec(parsed[0] if parsed else spec)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    for f in [*cfg.data.train_files, *cfg.data.eval_files]:
        if local and not Path(f).is_file():
            problems.append(f"data: prompt file not found: {f}")
    if cfg.eval.enabled and not cfg.data.eval_files and cfg.data.generate is None:
        problems.append("eval.enabled: no held-out prompts (data.eval_files or data.generate)")
    return problems


def check_teacher_context(cfg: RunConfig, prompts: list[str]) -> None:
    """ConfigError naming the record, the teacher's section and the field when a training record
    lacks a field of the `prompt_template` of a teacher it is routed to (`route.asks`: its route's
    teacher, or every teacher of route.mixture). `eopd run` checks it before any process starts and
    `eopd run --validate-only` the same way (`check_data`); the worker fills the same templates."""
    for name, t in cfg.all_teachers().items():
        if not t.prompt_template:
            continue
        try:
            teacher_prompt_texts(t.prompt_template, cfg.data.train_files, prompts,
                                 asks=functools.partial(cfg.route.asks, name), key=teacher_key(name))
        except DataError as exc:
            raise ConfigError(str(exc)) from None


def check_data(cfg: RunConfig) -> str:
    """`eopd run --validate-only`: what `eopd run` checks of the training data before it starts a
    process (`check_teacher_context`), on the data it would train on: data.train_files, or
    data.generate's training split, generated into a temporary directory. ConfigError as `eopd run`
    gives it; else a note of what was checked."""
    if not any(t.prompt_template for t in cfg.all_teachers().values()):
        return "no prompt_template to check against the data"
    with tempfile.TemporaryDirectory(prefix="eopd-validate-") as tmp:
        data = cfg.data
        if data.generate is not None:
            train, held = _generate_data(cfg, Path(tmp))
            data = data.model_copy(update={"train_files": [train], "eval_files": [held]})
        missing = [str(f) for f in data.train_files if not Path(f).is_file()]
        if missing:
            return f"the prompt_templates not checked against the data: {', '.join(missing)} not on this machine"
        try:
            prompts = load_prompts(data.train_files, data.field)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        check_teacher_context(cfg.model_copy(update={"data": data}), prompts)
    return f"every prompt_template checked against the {len(prompts)} training records"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; other preparers wait."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _generate_data(cfg: RunConfig, data_dir: Path) -> tuple[Path, Path]:
    """The generator's splits into `data_dir`, each file replaced atomically."""
    gen = cfg.data.generate
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=data_dir, prefix=".generate-"))
    try:
        out = []
        for path in write_splits(tmp, gen.train, gen.heldout, gen.seed, variants=gen.variants):
            final = data_dir / path.name
            os.replace(path, final)
            out.append(final)
        return out[0], out[1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _teacher_spec(cfg: RunConfig, student: str, run_dir: Path, materialise=materialise_spec) -> str:
    """The teacher spec the teacher process loads: a layer-subset spec is built like the student's
    (`teacher-init/`); the student's own spec is the student's initial weights (`student-init/`:
    self-distillation, usually with teacher.prompt_template)."""
    spec = cfg.teacher.model
    if not spec or parse_layer_subset(spec) is None:
        return spec
    if spec == cfg.student.model:
        return student
    return materialise(spec, run_dir / "teacher-init")


def prepare(cfg: RunConfig, *, overwrite: bool = False, keep_trained: bool = False,
            build_apart: bool = False) -> tuple[RunConfig, dict]:
    """Materialises the run directory; returns the config the processes load (concrete files and
    student directory) and facts for the run's summary. Does not write run.yaml (see
    `prepare_and_write`).

    A run directory holding a committed checkpoint: deleted with `overwrite`; else kept with
    `keep_trained` (`eopd prepare`, `eopd run --resume`); else refused. `build_apart`: a layer-subset
    model is built in a child process (`materialise_spec_apart`; `eopd run`, which lives on)."""
    run_dir = Path(cfg.run_dir).resolve()
    if (run_dir / "checkpoints" / "COMMITTED").exists():
        if overwrite:
            shutil.rmtree(run_dir)
        elif not keep_trained:
            raise ConfigError(f"{run_dir} already holds a trained run; pass --resume to continue it, --overwrite "
                              "or another run_dir=")
    run_dir.mkdir(parents=True, exist_ok=True)
    data = cfg.data
    updates: dict = {"run_dir": run_dir}
    with locked(run_dir / LOCK_NAME):
        if data.generate is not None:
            train, held = _generate_data(cfg, run_dir / "data")
            data = data.model_copy(update={"train_files": [train], "eval_files": [held]})
            updates["data"] = data
        materialise = materialise_spec_apart if build_apart else materialise_spec
        student = materialise(cfg.student.model, run_dir / "student-init")
        teacher = _teacher_spec(cfg, student, run_dir, materialise)
    updates["student"] = cfg.student.model_copy(update={"model": student})
    if teacher != cfg.teacher.model:
        updates["teacher"] = cfg.teacher.model_copy(update={"model": teacher})
    return cfg.model_copy(update=updates), {"student_init": student, "student_spec": cfg.student.model}


def prepare_and_write(cfg: RunConfig, *, overwrite: bool = False) -> tuple[Path, RunConfig]:
    """`eopd prepare`: prepares, then writes `<run_dir>/run.yaml` (atomically, under the lock)."""
    prepared, _facts = prepare(cfg, overwrite=overwrite, keep_trained=True)
    run_dir = Path(prepared.run_dir)
    path = run_dir / CONFIG_NAME
    with locked(run_dir / LOCK_NAME):
        write_atomic(path, dump_config(prepared))
    load_config(path)  # what the processes will load must validate
    return path, prepared


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eopd prepare",
        description="Prepare a run directory as `eopd run` does before starting processes: build a layer-subset "
        "student, generate the task data, write <run_dir>/run.yaml for the learner and the rollout workers. "
        "Idempotent and safe to run concurrently; prints the path of run.yaml.")
    p.add_argument("--config", required=True, help="run config YAML (configs/<preset>.yaml)")
    p.add_argument("--overwrite", action="store_true", help="delete the run directory (checkpoints included) first")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted paths (e.g. run_dir=/shared/runs/x)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        problems = validate(cfg, need_teacher=False)
        if problems:
            raise ConfigError("cannot prepare:\n" + "\n".join(f"  {p}" for p in problems))
        path, prepared = prepare_and_write(cfg, overwrite=args.overwrite)
    except (ConfigError, ValueError) as exc:  # ValueError: a layer selection the base model does not have
        print(f"eopd prepare: {exc}", file=sys.stderr)
        return 2
    files = ", ".join(str(f) for f in prepared.data.train_files + prepared.data.eval_files)
    print(f"eopd prepare: student {prepared.student.model}; data {files}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
