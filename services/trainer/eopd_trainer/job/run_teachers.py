"""The teachers `eopd run` starts (`RunTeachers`): `teacher.model` (the teacher named `teacher`, log
`teacher.log`) and each of `teachers:` that names a model (log `teacher-<name>.log`); one that
names only a target is someone else's service and is left alone; teachers of the same model and
dtype share one process (their requests differ only in what the worker sends: template, top-k). Each is `eopd-teacher serve` on
port 0 (teacher_proc.py) requiring the run's bearer token, new each start, in
`<run_dir>/teacher.token` (0600): every gRPC call but health, /metrics and /v1/completions (its probes
stay open). A teacher gets the file's path by environment (EOPD_TEACHER_AUTH_TOKEN_FILE), the workers
by run.yaml (`auth_token_file`); the token itself is on no command line and in no config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eopd_common.private_files import write_token_file

from ..config import DEFAULT_TEACHER, RunConfig
from .supervisor import Supervisor
from .teacher_proc import TeacherChild, start_teacher
from .threads import thread_env

TEACHER_TOKEN_NAME = "teacher.token"  # the bearer token of the teachers eopd run starts (0600, new each start)


def log_name(name: str) -> str:
    return "teacher" if name == DEFAULT_TEACHER else f"teacher-{name}"


class RunTeachers:
    """The teacher processes of one training attempt, by the run's teacher names."""

    def __init__(self, sup: Supervisor, run_dir: Path, timeout: float, say: Callable[[str], None]):
        self.sup, self.run_dir, self.timeout, self.say = sup, run_dir, timeout, say
        self.children: dict[str, TeacherChild] = {}

    def start(self, cfg: RunConfig, on_poll: Callable[[], None]) -> None:
        """Starts them; returns once each has reported the ports it bound (before its model loads)."""
        token_file = write_token_file(self.run_dir / TEACHER_TOKEN_NAME)
        by_model: dict[tuple[str, str], TeacherChild] = {}
        for name, t in cfg.all_teachers().items():
            if name != DEFAULT_TEACHER and not t.model:
                continue  # a target only: someone else's service
            if (t.model, t.dtype) in by_model:  # one process serves teachers of the same model (e.g. with and without a template)
                self.children[name] = by_model[(t.model, t.dtype)]
                self.say(f"teacher {name}: served by the process of {t.model} started for another teacher")
                continue
            self.children[name] = by_model[(t.model, t.dtype)] = child = start_teacher(
                self.sup, t.model, "--dtype", t.dtype, name=log_name(name),
                env={"EOPD_TEACHER_AUTH_TOKEN_FILE": str(token_file), **thread_env(cfg.threads, "teacher")},
                drop_env=("EOPD_TEACHER_AUTH_TOKEN",))  # "auth_token or auth_token_file"
            gp, _ = child.ports(self.timeout, on_poll=on_poll)
            label = "teacher" if name == DEFAULT_TEACHER else f"teacher {name}:"
            self.say(f"{label} {t.model} starting on 127.0.0.1:{gp} (log {child.log_path})")

    def effective(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with each started teacher's target and the run's token file (the workers' view)."""
        token = str(self.run_dir / TEACHER_TOKEN_NAME)

        def ours(name: str, t):
            child = self.children.get(name)
            return t if child is None else t.model_copy(update={"target": child.target, "auth_token_file": token})

        return cfg.model_copy(update={"teacher": ours(DEFAULT_TEACHER, cfg.teacher),
                                      "teachers": [ours(t.name, t) for t in cfg.teachers]})

    def alive(self) -> bool:
        return all(child.alive() for child in self.children.values())

    def wait_ready(self, on_poll: Callable[[], None]) -> None:
        processes = list({id(c): c for c in self.children.values()}.values())
        for child in processes:
            child.wait_ready(self.timeout, on_poll=on_poll)
        if processes:
            self.say(f"teacher{'s' if len(processes) > 1 else ''} ready; run directory {self.run_dir}")
