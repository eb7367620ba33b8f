"""Every teacher's `prompt_template` against the data (issue 49 ask 4): a record needs the fields of
the templates of the teachers it is routed to (its route's teacher, or every teacher of a mixture),
and no others; `eopd run` refuses a record lacking one before any process starts, and
`eopd run --validate-only` gives the same message, naming the record, the teacher's section and the
field. The worker fills the same templates for the same records (`TeacherPrompts(asks=...)`)."""

from __future__ import annotations

import functools

import pytest

from eopd_trainer.config import ConfigError, load_config
from eopd_trainer.data import load_prompts
from eopd_trainer.job.prepare import check_data, check_teacher_context
from eopd_trainer.teacher_context import TeacherPrompts
from tests.trainer.job.test_run_e2e import TINY
from tests.trainer.job.test_run_teachers import HINTED, hinted_file

MINUS = HINTED  # teacher `minus`, template '{prompt} Hint: {hint}'
ROUTE = ["route.field=kind", "route.routes={sub: minus}"]


def config(tmp_path, *overrides: str):
    path, rows = hinted_file(tmp_path)
    cfg = load_config(TINY, [f"data.train_files=[{path}]", *overrides])
    return cfg, load_prompts(cfg.data.train_files, cfg.data.field), rows


def test_a_template_needs_its_fields_only_in_the_records_routed_to_its_teacher(tmp_path):
    cfg, prompts, rows = config(tmp_path, MINUS, *ROUTE)
    check_teacher_context(cfg, prompts)  # the add records, routed to `teacher`, have no hint: fine
    assert check_data(cfg) == f"every prompt_template checked against the {len(rows)} training records"
    # the worker fills minus's template for its own records only, as the check did
    tp = TeacherPrompts(None, cfg.data, cfg.all_teachers()["minus"].prompt_template, prompts,
                        asks=functools.partial(cfg.route.asks, "minus"), key="teachers[minus]")
    assert tp.texts == [f"{r['prompt']} Hint: subtract" if r["kind"] == "sub" else None for r in rows]
    with pytest.raises(ValueError, match=r"teachers\[minus\].prompt_template: prompt 0 is not routed to this teacher"):
        tp.ids(0, [1, 2])


def test_a_record_lacking_a_field_of_its_teachers_template_is_refused_naming_all_three(tmp_path):
    # the default teacher's template needs the hint: the first add record (line 1) lacks it
    cfg, prompts, _ = config(tmp_path, MINUS, *ROUTE, "teacher.prompt_template='{prompt} ({hint})'")
    with pytest.raises(ConfigError, match=r"prompts\.jsonl:1: teacher\.prompt_template uses \{hint\} and the record has "
                       r"no field 'hint' \(it has \['answer', 'kind', 'prompt'\]\)"):
        check_teacher_context(cfg, prompts)
    # a named teacher's: the first sub record (line 2) lacks `solution`
    cfg, prompts, _ = config(tmp_path, MINUS.replace("{hint}", "{solution}"), *ROUTE)
    with pytest.raises(ConfigError, match=r"prompts\.jsonl:2: teachers\[minus\]\.prompt_template uses \{solution\}"):
        check_teacher_context(cfg, prompts)


def test_every_teacher_of_a_mixture_is_asked_for_every_record(tmp_path):
    cfg, prompts, _ = config(tmp_path, MINUS, "route.mixture={teacher: 0.5, minus: 0.5}")
    with pytest.raises(ConfigError, match=r"prompts\.jsonl:1: teachers\[minus\]\.prompt_template uses \{hint\}"):
        check_teacher_context(cfg, prompts)


def test_eopd_run_and_validate_only_refuse_it_alike_before_any_process(tmp_path, capsys):
    """The CLI in this process (the same code as the command, without two interpreter starts)."""
    from eopd_trainer.cli import main

    path, _ = hinted_file(tmp_path)
    run_dir = tmp_path / "run"
    args = ["--config", str(TINY), f"run_dir={run_dir}", f"data.train_files=[{path}]", "--no-eval", *ROUTE]
    bad = MINUS.replace("{hint}", "{solution}")
    said = "prompts.jsonl:2: teachers[minus].prompt_template uses {solution} and the record has no field 'solution'"
    assert main(["run", "--validate-only", *args, bad]) == 2
    checked = capsys.readouterr().err
    assert main(["run", *args, bad]) == 2
    ran = capsys.readouterr().err
    assert said in checked and said in ran
    assert checked.strip().splitlines()[-1] == ran.strip().splitlines()[-1]  # the same message
    assert not (run_dir / "logs").exists()  # no process started
    assert main(["run", "--validate-only", *args, MINUS]) == 0  # the sub records have the hint
    assert "every prompt_template checked against the 32 training records" in capsys.readouterr().out
