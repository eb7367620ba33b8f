"""`python -m eopd_trainer.learner` (also under torchrun and `deepspeed --module`): the learner,
same as `eopd-train`."""

import sys

from .cli import main

sys.exit(main())
