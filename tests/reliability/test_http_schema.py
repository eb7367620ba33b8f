"""The HTTP side fuzzed with schemathesis against its own OpenAPI schema, on the real server."""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.integration


def test_http_api_conforms_to_its_schema(tiny_teacher):
    schema = schemathesis.openapi.from_url(f"{tiny_teacher.http}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/healthz", "/readyz"}
    for op in operations:

        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=op.as_strategy())
        def check(case):
            # No server error, status codes and bodies as documented.
            case.call_and_validate()

        check()


def test_openapi_is_served(tiny_teacher):
    with urllib.request.urlopen(f"{tiny_teacher.http}/openapi.json", timeout=5) as r:
        doc = json.load(r)
    assert doc["info"]["title"] == "eopd teacher"
