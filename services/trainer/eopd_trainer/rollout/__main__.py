"""`python -m eopd_trainer.rollout`: the rollout worker (same as `eopd-rollout`)."""

import sys

from .cli import main

sys.exit(main())
