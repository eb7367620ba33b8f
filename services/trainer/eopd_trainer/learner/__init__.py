"""The learner: scored rollouts in, DeepSpeed optimizer steps, checkpoints and published weights out
(`eopd-train`, `python -m eopd_trainer.learner`, `torchrun -m eopd_trainer.learner`).

`loop.py` (LearnerLoop, the iteration loop), `feed.py` (RolloutFeed: rank 0's Redis side, torch-free),
`trainer.py` (PolicyTrainer: DeepSpeed, Redis-free), `records.py` (IterationLog), `cli.py`, and the
pieces they are built from: `ledger.py`, `rebuild.py`, `checkpoint.py`, `distributed.py`, `metrics.py`."""
