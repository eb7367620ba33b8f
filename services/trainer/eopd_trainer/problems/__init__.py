"""The problems a run trains and evaluates on, below both rollout/ and eval/ (which both use them):
`generator.py` writes the generated arithmetic / word-problem splits, `grading.py` grades an answer
against a reference (math-verify, strict and flexible)."""
