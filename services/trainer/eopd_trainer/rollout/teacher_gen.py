"""Off-policy responses (`TeacherGenerator`): the teacher generates the first `num_teacher_samples`
responses of a task (KD, the KD warm-up, GKD's teacher share) with `TeacherService.Generate`, which
returns, per generated position, the same statistics Score does; each becomes a Rollout of origin
"teacher" without a second scoring pass.

The request: the task's rendered prompt (as sent to Score: teacher.prompt_template's when set), max_new_tokens =
rollout.max_response_length, the rollout's temperature and top-p, stop ids = the student's EOS ids
(through teacher.token_remap), a seed from (run seed, task_seq) (`objective.step_seed`), the
statistics at teacher.top_k and teacher.temperature. The rollout: response ids and top-k ids mapped
back through the inverse remap, `old_logprobs` zeros ([n], documented as unused: no importance
ratio for a teacher-generated response), policy_version the worker's current one (for the record;
exempt from staleness), truncated when generation hit max_new_tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..config import RunConfig, TeacherConfig
from ..objective import step_seed
from ..queue.messages import ORIGIN_TEACHER, PromptTask, Rollout, now_ns
from ..teacher_context import TeacherPrompts
from .publisher import make_rollout
from .requests import TokenRemap

log = logging.getLogger("eopd.rollout")


def generation_seed(seed: int, task_seq: int) -> int:
    """The Generate seed of task `task_seq` (63 bits): the same task, the same request."""
    return step_seed(seed, task_seq, 0x6E6)  # a third key keeps it apart from the gkd draw's keys


class TeacherGenerator:
    """Asks the teacher to generate a task's off-policy responses and turns them into Rollouts."""

    def __init__(self, client, cfg: RunConfig, student_stop_ids: Sequence[int], worker_id: str,
                 teacher_prompts: TeacherPrompts | None = None, teacher: TeacherConfig | None = None, name: str = "teacher"):
        self.client = client
        self.cfg = cfg
        self.teacher = teacher or cfg.teacher  # its section: `teacher:` or one of `teachers:` (`name`)
        self.name = name
        self.worker_id = worker_id
        self.teacher_prompts = teacher_prompts or TeacherPrompts()  # the teacher's prefix (its prompt_template)
        self.remap = TokenRemap.of(self.teacher.token_remap)
        self.stop_ids = tuple(sorted({self.remap.teacher_id(i) for i in student_stop_ids}))

    def request_kwargs(self, task: PromptTask) -> dict:
        """The keyword arguments of `client.generate` for the task's teacher samples."""
        ro, te = self.cfg.rollout, self.teacher
        return dict(num_samples=task.num_teacher_samples, max_new_tokens=ro.max_response_length,
                    temperature=ro.temperature, top_p=ro.top_p, stop_token_ids=self.stop_ids,
                    seed=generation_seed(self.cfg.seed, task.task_seq), top_k=te.top_k,
                    score_temperature=te.temperature, timeout=te.timeout_s,
                    request_id=f"{self.worker_id}-{task.task_id}",
                    hidden_states="" if te.hidden_states == "none" else te.hidden_states)

    async def generate(self, task: PromptTask, prompt_ids: Sequence[int]) -> list:
        """The teacher's Generations for the task (sample_index 0 .. num_teacher_samples - 1), after
        the teacher's prefix for the student's `prompt_ids` (its own with teacher.prompt_template)."""
        prefix = self.teacher_prompts.ids(task.prompt_index, prompt_ids)
        gens = await self.client.generate([np.asarray(prefix, dtype=np.int64)], **self.request_kwargs(task))
        return sorted(gens, key=lambda g: g.sample_index)

    def problems(self, task: PromptTask, gens: list) -> str | None:
        """Why the answer cannot be used (None: it can): one generation per teacher sample, each
        with at least one token and one row of statistics per token."""
        want = list(range(task.num_teacher_samples))
        got = [int(g.sample_index) for g in gens]
        if got != want:
            return f"Generate returned samples {got}, expected {want}"
        for g in gens:
            n, s = len(g.token_ids), g.scores
            if n == 0:
                return f"Generate returned an empty response for sample {g.sample_index}"
            rows = {k: int(np.shape(getattr(s, k))[0]) for k in ("token_logprobs", "entropies", "topk_ids", "topk_logprobs")}
            wrong = {k: v for k, v in rows.items() if v != n}
            if wrong:
                return f"Generate returned {wrong} statistics rows for the {n} tokens of sample {g.sample_index}"
        return None

    def to_rollout(self, task: PromptTask, prompt_ids: Sequence[int], gen, *, policy_version: int,
                   teacher_model: str, reward: float | None = None) -> Rollout:
        """A Generation as a teacher-origin Rollout (student ids, old_logprobs zeros: unused)."""
        response = self.remap.student_ids(np.asarray(gen.token_ids, dtype=np.int32))
        t = now_ns()
        return make_rollout(task, int(gen.sample_index), prompt_ids, response,
                            np.zeros(len(response), dtype=np.float32), gen.scores, remap=self.remap,
                            rollout_cfg=self.cfg.rollout, worker_id=self.worker_id, policy_version=policy_version,
                            truncated=gen.finish_reason == "length", sampled_unix_ns=t, scored_unix_ns=t,
                            teacher_model=teacher_model, teacher=self.name, origin=ORIGIN_TEACHER, reward=reward)
