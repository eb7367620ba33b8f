"""The learner: scored rollouts in, DeepSpeed optimizer steps, checkpoints and published weights out
(`eopd-train`, `python -m eopd_trainer.learner`, `torchrun -m eopd_trainer.learner`).

`loop.py` (the Learner), `trainer.py` (loss terms, the fused-loss decision), `cli.py`, and the
pieces it is built from: `ledger.py`, `rebuild.py`, `checkpoint.py`, `distributed.py`, `metrics.py`."""
