"""Where the rollout side and the learner meet: a run's queue namespace (`namespace.py`, `RunQueue`:
the only port outside this package), the Redis streams (`streams.py`), the learner's lease
(`lease.py`), the messages on them (`messages.py`), the published weight files (`weights.py`) and
their announcement (`announce.py`)."""
