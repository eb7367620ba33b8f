"""The rollout side: tasks in, scored rollouts out (`eopd-rollout`, `python -m eopd_trainer.rollout`).

`worker.py` (RolloutWorker), `teacher_checks.py` (tokenizer and limits of the teacher),
`requests.py` (requests to the teacher and the checks of its answers), `metrics.py`, `cli.py`,
and `samplers/` (transformers or vLLM)."""
