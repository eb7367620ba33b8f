"""Privileged teacher context (`teacher.prompt_template`, issue 32 ask 3): the template's fields, the
errors that name the field and the record, the prefix the worker's RequestShaper sends, and, against
a real teacher server over TCP, that the teacher's answer to a privileged request is exactly a direct
Score of prefix + response at the response's positions (and not the plain prompt's answer)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from eopd_common.models import load_tokenizer
from eopd_teacher.client import AsyncTeacherClient, TeacherClient

from eopd_trainer.config import ConfigError, TeacherConfig, load_config
from eopd_trainer.data import DataError, load_prompts, render_prompt
from eopd_trainer.queue.messages import PromptTask
from eopd_trainer.rollout.requests import BatchQueue, Pending, RequestShaper
from eopd_trainer.teacher_context import TeacherPrompts, fill_template, teacher_prompt_texts, template_fields
from tests.procs import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
TEMPLATE = "{prompt}\nThe correct final answer is {answer}."


def test_template_fields_in_order_of_first_use():
    assert template_fields("{prompt} -- {answer} ({answer}), {{literal}} {hint_2}") == ["prompt", "answer", "hint_2"]
    assert template_fields("no fields") == []


@pytest.mark.parametrize("bad, says", [
    ("{prompt", "not a valid template"),
    ("{}", "not a plain name"),
    ("{0}", "not a plain name"),
    ("{rec.answer}", "not a plain name"),
    ("{rec[0]}", "not a plain name"),
    ("{answer!r}", "conversion or format spec"),
    ("{answer:>5}", "conversion or format spec"),
])
def test_template_refused_by_the_config_naming_the_key(bad, says):
    with pytest.raises(ValueError, match=says):
        template_fields(bad)
    with pytest.raises(ConfigError, match=r"teacher.prompt_template.*" + says):
        load_config(TINY, [f"teacher.prompt_template={json.dumps(bad)}"])


def test_fill_names_the_missing_field_and_the_record():
    rec = {"prompt": "What is 2 + 2?", "answer": 4, "_source": "f.jsonl:3"}
    assert fill_template(TEMPLATE, rec, "What is 2 + 2?", "f.jsonl:3") == "What is 2 + 2?\nThe correct final answer is 4."
    with pytest.raises(DataError, match=r"f.jsonl:3: teacher.prompt_template uses \{solution\} and the record has no "
                                        r"field 'solution' \(it has \['answer', 'prompt'\]\)"):
        fill_template("{prompt} {solution}", rec, "q", "f.jsonl:3")
    with pytest.raises(DataError, match=r"f.jsonl:3: .*'hint' is list, not text"):
        fill_template("{hint}", {"hint": [1]}, "q", "f.jsonl:3")


def test_prompt_texts_follow_the_prompts_and_fail_at_the_record(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "one", "answer": "1"}\n{"q": "two"}\n')
    prompts = load_prompts([data], "q")
    assert teacher_prompt_texts("{prompt}", [data], prompts) == ["one", "two"]  # {prompt}: data.field, whatever its name
    with pytest.raises(DataError, match=rf"{data}:2: .*no field 'answer'"):
        teacher_prompt_texts(TEMPLATE, [data], prompts)


def pending(index: int, prompt_ids: list[int], response: list[int], seq: int = 0) -> Pending:
    task = PromptTask(task_seq=seq, prompt_index=index, num_samples=1, min_policy_version=0)
    return Pending(f"e{seq}", task, 0, prompt_ids, response, False, np.zeros(len(response), np.float32), 0, 0)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY, [f"teacher.prompt_template={json.dumps(TEMPLATE)}"])  # quoted: {...} alone is a YAML mapping
    tok = load_tokenizer(cfg.student.model)
    prompts = load_prompts(cfg.data.train_files, cfg.data.field)
    d = cfg.data
    student = [render_prompt(tok, p, suffix=d.suffix, chat_template=d.chat_template, max_length=d.max_prompt_length)
               for p in prompts[:3]]
    return cfg, tok, prompts, student


def test_shaper_sends_the_rendered_template_and_scores_only_the_response(tiny):
    cfg, tok, prompts, student = tiny
    tp = TeacherPrompts(tok, cfg.data, cfg.teacher.prompt_template, prompts)
    assert tp.privileged and tp.texts[0] == f"{prompts[0]}\nThe correct final answer is 54."
    want = render_prompt(tok, tp.texts[0], suffix=cfg.data.suffix, chat_template=cfg.data.chat_template)
    assert tp.ids(0, student[0]) == want and len(want) > len(student[0])
    response = [42, 43, 44]
    (batch,), refused = RequestShaper("w", cfg.teacher, None, tp).shape([pending(0, student[0], response)])
    (seq,) = batch.sequences
    assert refused == [] and list(seq.token_ids) == want + response and seq.score_from == len(want)
    # Without a template the teacher sees the student's prompt, as before.
    (batch,), _ = RequestShaper("w", TeacherConfig(), None, TeacherPrompts()).shape([pending(0, student[0], response)])
    assert list(batch.sequences[0].token_ids) == student[0] + response and batch.sequences[0].score_from == len(student[0])


def test_a_prefix_over_the_teachers_context_refuses_that_rollout_only(tiny):
    cfg, tok, prompts, student = tiny
    tp = TeacherPrompts(tok, cfg.data, cfg.teacher.prompt_template, prompts)
    long_one, fits = pending(0, student[0], [5] * 8, seq=0), pending(1, student[1], [5] * 2, seq=1)
    limit = len(tp.ids(0, student[0])) + 4
    assert len(tp.ids(1, student[1])) + 2 <= limit
    batches, refused = RequestShaper("w", cfg.teacher, None, tp, max_context_length=limit).shape([long_one, fits])
    assert [s.id for b in batches for s in b.sequences] == [fits.rollout_id]
    ((p, why),) = refused
    assert p is long_one
    assert why == (f"prompt 0: teacher.prompt_template's prompt ({len(tp.ids(0, student[0]))} tokens) + the response (8) "
                   f"= {len(tp.ids(0, student[0])) + 8} tokens exceeds the teacher's max_context_length ({limit})")


@pytest.mark.integration
def test_privileged_answer_equals_a_direct_score_of_prefix_plus_response(tiny, tiny_teacher):
    """Through the worker's own path (RequestShaper -> AsyncTeacherClient.score_stream, a real server
    over TCP): the answer's rows are the teacher's statistics at the response's positions after the
    privileged prefix, equal to a direct unary Score of the whole prefix + response (scored from its
    second token) cut to those positions; and they differ from the plain prompt's."""
    cfg, tok, prompts, student = tiny
    tp = TeacherPrompts(tok, cfg.data, cfg.teacher.prompt_template, prompts)
    rng = np.random.default_rng(0)
    rollouts = [pending(i, student[i], rng.integers(100, 5000, size=n).tolist(), seq=i) for i, n in enumerate((5, 9, 3))]
    shaper = RequestShaper("w", cfg.teacher, None, tp)
    batches, refused = shaper.shape(rollouts)
    assert refused == []

    async def stream():
        client = AsyncTeacherClient(tiny_teacher.target, timeout=120)
        queue = BatchQueue(maxsize=8)
        for b in batches:
            await queue.put(b)
        await queue.close()
        try:
            return {rid: ans async for rid, ans in client.score_stream(queue, on_error="yield")}
        finally:
            await client.close()

    answers = asyncio.run(stream())
    got = {s.seq_id: s for b in batches for s in answers[b.request_id]}
    top_k = cfg.teacher.top_k
    with TeacherClient(tiny_teacher.target, timeout=120) as client:
        for p in rollouts:
            prefix = tp.ids(p.task.prompt_index, p.prompt_ids)
            (full,) = client.score([("full", prefix + p.response_ids, 1)], top_k=top_k, temperature=cfg.teacher.temperature)
            (plain,) = client.score([("plain", p.prompt_ids + p.response_ids, len(p.prompt_ids))], top_k=top_k,
                                    temperature=cfg.teacher.temperature)
            n, s = len(p.response_ids), got[p.rollout_id]
            assert np.shape(s.token_logprobs) == (n,) and np.shape(s.topk_ids) == (n, top_k)
            np.testing.assert_allclose(s.token_logprobs, full.token_logprobs[-n:], atol=1e-5)
            np.testing.assert_allclose(s.entropies, full.entropies[-n:], atol=1e-5)
            np.testing.assert_allclose(s.topk_logprobs, full.topk_logprobs[-n:], atol=1e-5)
            assert (np.asarray(s.topk_ids)[:, 0] == np.asarray(full.topk_ids)[-n:, 0]).all()
            assert np.abs(np.asarray(s.token_logprobs) - np.asarray(plain.token_logprobs)).max() > 1e-4


def test_teacher_generation_starts_from_the_privileged_prefix(tiny):
    """KD / GKD / the warm-up: Generate gets the teacher's prefix, not the student's prompt (a
    recording client: the request the worker makes is the point here; the real Generate path runs
    end to end in tests/trainer/job/test_run_datapath.py)."""
    from eopd_trainer.rollout.teacher_gen import TeacherGenerator

    cfg, tok, prompts, student = tiny
    tp = TeacherPrompts(tok, cfg.data, cfg.teacher.prompt_template, prompts)
    sent = []

    class Recording:
        async def generate(self, prompts_sent, **kwargs):
            sent.append([list(map(int, p)) for p in prompts_sent])
            return []

    task = PromptTask(task_seq=0, prompt_index=1, num_samples=2, min_policy_version=0, num_teacher_samples=2)
    asyncio.run(TeacherGenerator(Recording(), cfg, [2], "w", tp).generate(task, student[1]))
    asyncio.run(TeacherGenerator(Recording(), cfg, [2], "w").generate(task, student[1]))
    assert sent == [[tp.ids(1, student[1])], [student[1]]] and tp.ids(1, student[1]) != student[1]
