"""Several teachers in one run (issue 32 asks 1, 2, 5): the config's teachers by name and its route,
their errors, the route of every prompt, and `eopd run` end to end with two teacher processes routed
by a field of the data record (tiny preset, real processes)."""

from __future__ import annotations

import json

import pytest

from eopd_trainer.config import ConfigError, RouteConfig, load_config
from eopd_trainer.rollout.teacher_links import prompt_routes
from tests.procs import ROOT
from tests.trainer.job.test_run_e2e import TINY, eopd

MINUS = "teachers=[{name: minus, model: tiny-random@2}]"


def kinds_file(tmp_path):
    """tests/data/tiny_prompts.jsonl with a `kind` field: sub for subtraction prompts, else add."""
    out = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "tiny_prompts.jsonl").read_text().splitlines()]
    out.write_text("".join(json.dumps({**r, "kind": "sub" if " - " in r["prompt"] else "add"}) + "\n" for r in rows))
    return out, rows


def hinted_file(tmp_path):
    """kinds_file's records with, on the sub records only, a `hint`: the field of HINTED's template
    (issue 49: a record routed to another teacher needs none of its fields)."""
    path, _ = kinds_file(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [{**r, **({"hint": "subtract"} if r["kind"] == "sub" else {})} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


HINTED = "teachers=[{name: minus, model: tiny-random@2, prompt_template: '{prompt} Hint: {hint}'}]"


def test_teachers_by_name_and_the_route():
    cfg = load_config(TINY, [MINUS, "route.field=kind", "route.routes={sub: minus}"])
    assert list(cfg.all_teachers()) == ["teacher", "minus"] and cfg.all_teachers()["minus"].model == "tiny-random@2"
    assert cfg.all_teachers()["minus"].top_k == 16  # each teacher its own section, with the section's defaults
    route = cfg.route
    assert [route.teacher_of(r) for r in ({"kind": "sub"}, {"kind": "add"}, {})] == ["minus", "teacher", "teacher"]
    assert load_config(TINY).all_teachers() == {"teacher": load_config(TINY).teacher}  # a single teacher: as before
    # whom the workers connect to, from the config alone (they wait for the teachers before loading anything)
    assert route.teacher_names() == ["teacher", "minus"] and load_config(TINY).route.teacher_names() == ["teacher"]
    mixed = load_config(TINY, [MINUS, "route.mixture={minus: 0.5, teacher: 0.5}"])
    assert mixed.route.teacher_names() == ["minus", "teacher"]


@pytest.mark.parametrize("overrides, says", [
    ([MINUS, "route.field=kind", "route.routes={sub: plus}"], r"route.routes\['sub'\]: unknown teacher 'plus'; the teachers are \['teacher', 'minus'\]"),
    ([MINUS], r"teachers: \['minus'\] reached by no route"),
    (["route.default=minus"], r"route.default: unknown teacher 'minus'"),
    (["route.routes={sub: teacher}"], "route.routes is set but route.field is empty"),
    (["teachers=[{name: teacher, model: tiny-random@2}]"], "the name 'teacher' is the `teacher:` section's"),
    (["teachers=[{name: a, model: x}, {name: a, model: y}]", "route.default=a"], r"names must be unique; \['a'\]"),
    (["teachers=[{name: 'Two Words'}]"], "must be 1-32 of a-z"),
])
def test_bad_teachers_and_routes_are_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY, overrides)


def test_every_prompt_routed_by_its_record(tmp_path):
    path, rows = kinds_file(tmp_path)
    route = RouteConfig(field="kind", routes={"sub": "minus"})
    assert prompt_routes(route, [path], len(rows)) == ["minus" if " - " in r["prompt"] else "teacher" for r in rows]
    assert prompt_routes(RouteConfig(), [path], len(rows)) == ["teacher"] * len(rows)


@pytest.mark.integration
def test_two_teachers_routed_by_problem_kind_end_to_end(tmp_path):
    """`eopd run` starts both teachers (teacher.log, teacher-minus.log), the worker connects to both
    and routes each prompt by its record's `kind`; every rollout is trained; the learner records the
    statistics of each teacher (token shares summing to 1) and `eopd report` draws them. `minus` has
    a prompt_template whose field only its own (sub) records have (issue 49: the add records, routed
    to `teacher`, need none; the worker used to die on them after start)."""
    path, _ = hinted_file(tmp_path)
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", f"data.train_files=[{path}]", "train.iterations=2",
               HINTED, "route.field=kind", "route.routes={sub: minus}", "eval.models=[final]", timeout=1200)
    assert res.returncode == 0, res.stderr[-5000:]
    assert "teacher minus: tiny-random@2 starting on 127.0.0.1:" in res.stderr and "teachers ready" in res.stderr
    assert (run_dir / "logs" / "teacher-minus.log").is_file() and (run_dir / "logs" / "teacher.log").is_file()
    worker = (run_dir / "logs" / "rollout-w0.log").read_text()
    assert "teachers[minus] " in worker and "ready" in worker
    assert "teachers[minus].prompt_template: the teacher sees its own prompt, e.g. 'What is 18 - 34? Hint: subtract'" in worker
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert "training finished: 2 iterations, 16 rollouts trained" in learner and "dead letter" not in learner
    iters = [r for r in map(json.loads, (run_dir / "train_metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "iteration"]
    seen = set()
    for r in iters:
        shares = {k.split("/")[2]: v for k, v in r.items() if k.startswith("iter/by_teacher/") and k.endswith("/token_share")}
        assert shares and sum(shares.values()) == pytest.approx(1.0)
        seen |= set(shares)
        for name in shares:
            assert 0.0 <= r[f"iter/by_teacher/{name}/gate_ratio"] <= 1.0 and f"iter/by_teacher/{name}/reverse_kl" in r
    assert seen == {"teacher", "minus"}
    res = eopd("report", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Per teacher: gate ratio" in (run_dir / "report.html").read_text()


def test_the_learner_admits_each_teachers_top_k_and_pads_them_together():
    """Teachers of different top_k (tiny: teacher 64, minus 16): a rollout of either k is admitted,
    another k is refused naming the teachers' values, and a micro-batch of both packs to the largest
    k with zero-mass (-inf) filler, which the forward KL ignores."""
    import numpy as np

    from eopd_trainer.batching import pack_rollouts
    from eopd_trainer.queue.messages import PoisonMessage, RolloutLimits, decode_rollout, encode_rollout
    from tests.trainer.test_pipeline_units import make_rollout

    limits = RolloutLimits.from_config(load_config(TINY, [MINUS, "route.field=kind", "route.routes={sub: minus}"]))
    assert (limits.top_k, limits.top_ks) == (64, (16, 64))
    assert RolloutLimits.from_config(load_config(TINY)).top_ks == ()  # one teacher: exactly its top_k, as before
    a, b = make_rollout("t0-s0", n=3, k=16), make_rollout("t1-s0", n=2, k=64, seed=1)
    for r in (a, b):
        assert decode_rollout(encode_rollout(r), limits=limits).top_k == r.top_k
    with pytest.raises(PoisonMessage, match=r"top_k 8 differs from any teacher's top_k \[16, 64\]"):
        decode_rollout(encode_rollout(make_rollout(n=2, k=8)), limits=limits)
    packed = pack_rollouts([a, b], pad_id=0)
    lp = packed.loss_inputs.teacher_topk_logprobs.numpy()
    assert lp.shape == (5, 64) and np.isneginf(lp[:3, 16:]).all() and np.isfinite(lp[3:]).all()


@pytest.mark.parametrize("overrides, says", [
    ([MINUS, "route.mixture={teacher: 0.5, minus: 0.6}"], r"route.mixture: weights must sum to 1, they sum to 1.1"),
    ([MINUS, "route.mixture={teacher: 1.0, minus: 0.0}"], r"route.mixture: weights must be > 0"),
    ([MINUS, "route.mixture={teacher: 0.5, plus: 0.5}"], r"route.mixture: unknown teachers \['plus'\]"),
    ([MINUS, "route.mixture={minus: 1.0}"], "name at least two teachers"),
    ([MINUS, "route.mixture={teacher: 0.5, minus: 0.5}", "route.field=kind"], "either routes each prompt"),
    ([MINUS, "route.mixture={teacher: 0.5, minus: 0.5}", "train.warmup_kd_iterations=1"],
     "not with a teacher generating responses"),
])
def test_bad_mixtures_are_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY, overrides)


@pytest.mark.integration
def test_a_mixture_of_a_plain_and_a_privileged_teacher_end_to_end(tmp_path):
    """route.mixture of the teacher and the same model given the answer (`hinted`: one process serves
    both, the worker sends each response twice, with and without the template); each rollout
    carries both, the learner's loss is their weighted sum, and it records each teacher's FKL at
    high-entropy positions (from the loss) beside the statistics of its scores."""
    run_dir = tmp_path / "run"
    hinted = 'teachers=[{name: hinted, model: "tiny-random@0", prompt_template: "{prompt} The answer is {answer}."}]'
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", "train.iterations=2", hinted,
               "route.mixture={teacher: 0.25, hinted: 0.75}", "eval.models=[final]", timeout=1200)
    assert res.returncode == 0, res.stderr[-5000:]
    assert "teacher hinted: served by the process of tiny-random@0 started for another teacher" in res.stderr
    assert not (run_dir / "logs" / "teacher-hinted.log").exists()
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert "training finished: 2 iterations, 16 rollouts trained" in learner and "dead letter" not in learner
    iters = [r for r in map(json.loads, (run_dir / "train_metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "iteration"]
    for r in iters:
        for name in ("teacher", "hinted"):
            assert r[f"iter/by_teacher/{name}/token_share"] == 1.0  # every token scored by both
            assert f"iter/by_teacher/{name}/fkl_gated_mean" in r and f"iter/by_teacher/{name}/reverse_kl" in r
        assert r["iter/by_teacher/teacher/teacher_entropy"] != r["iter/by_teacher/hinted/teacher_entropy"]
