"""The rollout side: tasks in, scored rollouts out (`eopd-rollout`, `python -m eopd_trainer.rollout`).

`worker.py` (RolloutWorker: set-up and main loop), `student_samples.py` (the student's samples),
`teacher_gen.py` and `teacher_samples.py` (the teacher's samples: Generate, then published),
`grader.py` and `graded.py` (grpo: rewards, graded samples published), `requests.py` (requests to
the teacher and the checks of its answers), `answers.py` (the teacher's answers published),
`teacher_wait.py` and `teacher_checks.py` (waiting for the teacher; its tokenizer and limits),
`task_book.py`, `versions.py`, `publisher.py`, `metrics.py`, `cli.py`, and `samplers/`
(transformers or vLLM)."""
