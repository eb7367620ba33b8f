"""The deployment checks' shared helpers (deploy_env.py) assert too: pytest rewrites their asserts
as it does the tests' own, so a failing helper shows the values it compared."""

import pytest

pytest.register_assert_rewrite("tests.deploy.deploy_env")
