"""`python -m eopd_teacher.cli`: the `eopd-teacher` command."""

import sys

from .main import main

sys.exit(main())
