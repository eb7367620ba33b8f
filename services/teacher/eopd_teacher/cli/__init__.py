"""The `eopd-teacher` command (`main`): serve | info | score | generate. `main.py` parses and runs
the commands, `generate.py` is `generate`, `text.py` encodes text prompts with a tokenizer."""

from .main import main

__all__ = ["main"]
