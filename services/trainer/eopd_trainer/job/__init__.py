"""`eopd run` and `eopd prepare`: the whole job on one machine (`run.py`), its processes
(`supervisor.py`), the run directory (`prepare.py`, `resume.py`, `run_record.py`) and the queue it
picks (`local_queue.py`, `embedded_queue.py`)."""
