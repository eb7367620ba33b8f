"""The student's samples of a round of tasks (`StudentSamples`): each task's responses after its
teacher share (sample indices num_teacher_samples .. num_samples - 1), sampled in chunks of
`rollout.generation_batch_size` with the policy version the worker holds, with their old
log-probs (and, when the loss variant needs per-position candidates, the student's top-k ids).
Also the prompt cache: a task's rendered prompt ids, shared with the teacher's samples."""

from __future__ import annotations

from ..config import RunConfig
from ..data import render_prompt
from ..faults import Faults
from ..queue.messages import PromptTask, now_ns
from .publisher import Publisher
from .requests import Pending
from .versions import VersionTracker


class StudentSamples:
    """Samples tasks' student responses with `sampler` (blocking: called in a thread)."""

    def __init__(self, cfg: RunConfig, sampler, prompts: list, faults: Faults, versions: VersionTracker,
                 publisher: Publisher):
        self.cfg = cfg
        self.sampler = sampler
        self.tokenizer = sampler.tokenizer
        self.prompts = prompts
        self.faults = faults
        self.versions = versions
        self.publisher = publisher  # its count of published rollouts keys the `rollout.sample` fault point
        self._prompt_cache: dict[int, list[int]] = {}

    def prompt_ids(self, index: int) -> list[int]:
        """Prompt `index` rendered as the student's token ids (data.suffix, chat template, max length)."""
        ids = self._prompt_cache.get(index)
        if ids is None:
            d = self.cfg.data
            ids = self._prompt_cache[index] = render_prompt(
                self.tokenizer, self.prompts[index], suffix=d.suffix, chat_template=d.chat_template,
                max_length=d.max_prompt_length)
        return ids

    def sample(self, work: list[tuple[str, PromptTask]]) -> list[Pending]:
        """The student samples of the tasks `work` ((entry id, task) pairs), one Pending each."""
        ro = self.cfg.rollout
        self.faults.hit("rollout.sample", count=self.publisher.published)
        # The first num_teacher_samples of a task are the teacher's (Generate); the student samples the rest.
        flat = [(eid, task, j) for eid, task in work for j in range(task.num_teacher_samples, task.num_samples)]
        out: list[Pending] = []
        for start in range(0, len(flat), ro.generation_batch_size):
            chunk = flat[start : start + ro.generation_batch_size]
            prompts = [self.prompt_ids(task.prompt_index) for _, task, _ in chunk]
            # One seed per sample (vLLM seeds each sequence; transformers seeds the batch with the first).
            seeds = [(self.cfg.seed * 1_000_003 + task.task_seq * 101 + j) % (2**31) for _, task, j in chunk]
            samples = self.sampler.sample(prompts, seeds, temperature=ro.temperature, top_p=ro.top_p,
                                          max_new_tokens=ro.max_response_length)
            old, tops = self._old_logprobs(samples)
            t = now_ns()
            for (eid, task, j), s, lp, top in zip(chunk, samples, old, tops, strict=True):
                out.append(Pending(eid, task, j, s.prompt_ids, s.response_ids, s.truncated, lp,
                                   self.versions.version, t, top))
        return out

    def _old_logprobs(self, samples) -> tuple[list, list]:
        """Old log-probs, and the student's top-k ids per position when the loss variant needs
        per-position candidates (loss.num_candidates, from the same pass)."""
        temperature, k = self.cfg.rollout.temperature, self.cfg.loss.num_candidates
        if k:
            return self.sampler.old_logprobs_topk(samples, temperature=temperature, k=k)
        return self.sampler.old_logprobs(samples, temperature=temperature), [None] * len(samples)
