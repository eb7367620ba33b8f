"""The worker's task grader (`TaskGrader`, variant grpo): a response's reward is 1.0 when the answer
it states equals the training row's `answer`, else 0.0, by the same extraction and math-verify
grading `eopd eval` uses (`problems/grading.is_correct`, extraction `eval.headline`: strict = the last
\\boxed{}, flexible = the last number)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..data import DataError, read_records
from ..problems.grading import Mode, is_correct


def load_answers(paths: Sequence[Path]) -> list[str]:
    """The `answer` field of every training record, in the order of `load_prompts` (a task's
    prompt_index indexes both); DataError naming the first record without one."""
    answers: list[str] = []
    for path in paths:
        for i, rec in enumerate(read_records(path)):
            if "answer" not in rec:
                where = rec.get("_source", f"{path}[{i}]")
                raise DataError(f"{where}: no field 'answer': loss.variant=grpo grades each response against the "
                                "training record's answer (data.train_files)")
            answers.append(str(rec["answer"]))
    return answers


class TaskGrader:
    """Rewards of responses to the training prompts: `reward(prompt_index, response_ids) -> 0.0 | 1.0`."""

    def __init__(self, answers: Sequence[str], tokenizer, mode: Mode = "strict"):
        self.answers = list(answers)
        self.tokenizer = tokenizer
        self.mode = mode

    @classmethod
    def from_files(cls, paths: Sequence[Path], tokenizer, mode: Mode = "strict") -> TaskGrader:
        return cls(load_answers(paths), tokenizer, mode)

    def reward(self, prompt_index: int, response_ids: Sequence[int]) -> float:
        """1.0 when the decoded response's answer (`mode` extraction) equals the prompt's, else 0.0."""
        text = self.tokenizer.decode(list(response_ids), skip_special_tokens=True)
        return 1.0 if is_correct(text, self.answers[prompt_index], self.mode) else 0.0
