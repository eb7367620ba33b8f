"""Evaluation: `eopd eval` (`evaluate.py`), KL to a local teacher (`kl.py`), grading (`grading.py`),
the generated tasks (`tasks.py`), `eopd report` (`report.py`), and the experiment's tables and
figures (`experiment_table.py`, `experiment_figures.py`)."""
