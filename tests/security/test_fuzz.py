"""Schemathesis against a real server's OpenAPI schema: every operation, a bounded number of generated
requests each (derandomized, so CI runs are repeatable), with the admin token so the upload path is
fuzzed too. No answer may be a 5xx (503 "busy / not ready" aside) or leak internals, and the server must
still be alive and serving the model afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import builders
import httpx
import numpy as np
import pytest
from inprocess import assert_no_leak
from live_server import AUTH, Server, running, upload

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - installed with schemathesis

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLES = 12
TINY = builders.tiny_cnn(seed=4)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("fuzz")
    env = {"SERVICE_MAX_UPLOAD_MB": "1", "SERVICE_MAX_REQUEST_MB": "1", "SERVICE_LOG_LEVEL": "warning"}
    with running(tmp / "models", tmp / "logs", env=env) as srv:
        assert upload(srv.url, "tiny", TINY).status_code == 201
        yield srv


def _check(case, server: Server) -> None:
    headers = {**AUTH, **(case.headers or {})}
    response = case.call(headers=headers, timeout=60)
    label = f"{case.method} {case.formatted_path}"
    assert response.status_code < 500 or response.status_code == 503, (label, response.text[:300])
    if response.status_code >= 400:
        assert_no_leak(_without_echoes(response.text, case), Path(server.model_dir))
        assert set(response.json()) <= {"error", "ready"}, (label, response.text[:300])


def _sent_values(case) -> list[str]:
    """The path and query values the client sent, as text."""
    values: list[str] = []
    for part in (case.path_parameters, case.query):
        for value in (part or {}).values():
            values.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return [v for v in values if v]


def _without_echoes(text: str, case) -> str:
    """``text`` with the client's own path and query values cut out (verbatim and JSON-escaped): an error
    that names the model the client asked for reveals nothing, so only what is left is checked for leaks."""
    for value in sorted(_sent_values(case), key=len, reverse=True):
        text = text.replace(json.dumps(value)[1:-1], "").replace(value, "")
    return text


def _fuzz(operation, server: Server, calls: dict[str, int]) -> None:
    label = operation.label

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy())
    def fuzz(case) -> None:
        calls[label] = calls.get(label, 0) + 1
        _check(case, server)

    fuzz()


def test_no_server_errors(server: Server) -> None:
    """Every operation of the schema, fuzzed in turn (schemathesis' own pytest plugin is driven by
    hand: its fixture integration does not work with pytest 9)."""
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10
    calls: dict[str, int] = {}
    for operation in operations:
        _fuzz(operation, server, calls)
    assert len(calls) == len(operations) and sum(calls.values()) >= 5 * len(operations), calls
    assert server.proc.poll() is None


def test_still_serving_after_the_fuzzing(server: Server) -> None:
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    r = httpx.post(f"{server.url}/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}}, timeout=30)
    if r.status_code == 404:  # the fuzzer may legitimately have deleted tiny's version 1
        assert upload(server.url, "tiny", TINY).status_code == 201
        r = httpx.post(f"{server.url}/predict", json={"model": "tiny", "inputs": {"input": x.tolist()}}, timeout=30)
    assert r.status_code == 200, r.text
    want = builders.reference(TINY, {"input": x})["logits"]
    np.testing.assert_allclose(np.asarray(r.json()["outputs"]["logits"], np.float32), want, rtol=1e-4, atol=1e-5)
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
    assert server.proc.poll() is None
