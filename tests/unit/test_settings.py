"""Service settings: removed variables stop the server with one line, bad values are named but never echoed,
the list stays short, and a model's config shares every bound with the settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.model_config import ModelConfig
from service.settings import (
    ADVANCED,
    MAX_BUCKETS,
    REMOVED,
    USER,
    ServiceSettings,
    SettingsError,
    check_environment,
    load_settings,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_service_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the SERVICE_ variables it sets itself."""
    for key in list(os.environ):
        if key.startswith("SERVICE_"):
            monkeypatch.delenv(key)


# ------------------------------------------------------------------------------------ removed variables


@pytest.mark.parametrize("old", sorted(REMOVED))
def test_every_removed_variable_stops_with_one_line_naming_it_and_its_replacement(old):
    with pytest.raises(SettingsError) as info:
        check_environment({f"SERVICE_{old}": "1", "PATH": "/bin"})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"SERVICE_{old} ")
    assert REMOVED[old] in message


def test_a_removed_variable_in_the_environment_stops_load_settings(monkeypatch):
    monkeypatch.setenv("SERVICE_BATCHING__ENABLED", "false")
    with pytest.raises(SettingsError, match="SERVICE_BATCHING__ENABLED was removed: use SERVICE_MAX_BATCH_SIZE=1"):
        load_settings()


def test_an_unlisted_variable_of_an_old_group_is_refused_too():
    with pytest.raises(SettingsError) as info:
        check_environment({"SERVICE_ENGINE__SOMETHING_NEW": "1"})
    assert str(info.value).startswith("SERVICE_ENGINE__SOMETHING_NEW is not a setting any more")


def test_current_and_foreign_variables_pass_and_the_first_removed_one_is_named():
    check_environment({"SERVICE_MAX_BATCH_SIZE": "8", "SERVICE_TUNE_BUDGET_S": "0", "BATCHING__ENABLED": "0"})
    with pytest.raises(SettingsError) as info:
        check_environment({"SERVICE_HEAP_KEEP_MB": "1", "SERVICE_BATCHING__QUEUE_SIZE": "1"})
    assert str(info.value).startswith("SERVICE_BATCHING__QUEUE_SIZE ")


def test_no_removed_name_is_a_current_setting():
    current = {name.upper() for name in ServiceSettings.model_fields}
    assert not current & set(REMOVED)
    for replacement in REMOVED.values():  # a named replacement is a real variable
        for word in replacement.split():
            if word.startswith("SERVICE_"):
                assert word.split("=")[0].removeprefix("SERVICE_").lower() in ServiceSettings.model_fields, word


# ------------------------------------------------------------------------------------ bad values


def test_a_short_admin_token_is_named_but_never_echoed(monkeypatch):
    monkeypatch.setenv("SERVICE_ADMIN_TOKEN", "hunter2-secret")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message == "SERVICE_ADMIN_TOKEN: must be at least 16 characters"
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SERVICE_PORT", "99999"),
        ("SERVICE_MAX_BATCH_SIZE", "77777"),
        ("SERVICE_MAX_DELAY_MS", "-3.25"),
        ("SERVICE_REQUEST_TIMEOUT_S", "nonsense-timeout"),
        ("SERVICE_LOG_LEVEL", "chatty"),
        ("SERVICE_BUCKETS", "[0, 4]"),
        ("SERVICE_BUCKETS", "1,2,4"),  # not JSON: pydantic-settings' own error, not a ValidationError
        ("SERVICE_BUCKETS", "[8, 16"),
        ("SERVICE_DEVICE", "tpu9"),
        ("SERVICE_WORKERS", "6500"),
        ("SERVICE_HOST", "evil.example"),
    ],
)
def test_a_bad_value_gives_one_line_naming_the_variable_without_the_value(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"{variable}: ")
    assert "\n" not in message and value not in message


def test_several_bad_values_are_all_named_on_one_line():
    with pytest.raises(SettingsError) as info:
        load_settings(max_batch_size=0, queue_size=0)
    message = str(info.value)
    assert "\n" not in message
    assert "SERVICE_MAX_BATCH_SIZE: " in message and "SERVICE_QUEUE_SIZE: " in message


@pytest.mark.parametrize(
    ("cert", "key", "why"),
    [
        ("missing-cert.pem", "missing-key.pem", "No such file or directory"),
        ("not-pem.txt", "not-pem.txt", "not a PEM certificate chain and its private key"),
    ],
)
def test_a_tls_pair_that_does_not_load_is_named_without_its_paths(monkeypatch, tmp_path, cert, key, why):
    (tmp_path / "not-pem.txt").write_text("hello\n")
    monkeypatch.setenv("SERVICE_TLS_CERT_FILE", str(tmp_path / cert))
    monkeypatch.setenv("SERVICE_TLS_KEY_FILE", str(tmp_path / key))
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("SERVICE_TLS_CERT_FILE, SERVICE_TLS_KEY_FILE: cannot load them: ") and why in message
    assert str(tmp_path) not in message and "\n" not in message


def test_half_a_tls_pair_names_both_variables(monkeypatch):
    monkeypatch.setenv("SERVICE_TLS_KEY_FILE", "key.pem")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == "set both SERVICE_TLS_CERT_FILE and SERVICE_TLS_KEY_FILE, or neither"


def test_good_values_load():
    settings = load_settings(max_batch_size=1, tune_budget_s=0, buckets=(8, 1, 8), admin_token="x" * 16)
    assert settings.max_batch_size == 1 and settings.tune_budget_s == 0.0
    assert settings.buckets == (1, 8)
    assert settings.admin_token is not None and "x" * 16 not in repr(settings)


def _serve(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env.update(SERVICE_MODEL_DIR=str(tmp_path / "models"), SERVICE_PORT="0", SERVICE_DEMO_MODEL="false")
    env.update(environment)
    return subprocess.run(
        [sys.executable, "-m", "service", "serve"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("environment", "named", "hidden"),
    [
        ({"SERVICE_ADMIN_TOKEN": "tok3n-value"}, "SERVICE_ADMIN_TOKEN", "tok3n-value"),
        ({"SERVICE_ENGINE__AUTOTUNE": "false"}, "SERVICE_ENGINE__AUTOTUNE was removed", None),
        ({"SERVICE_BUCKETS": "1,2,4"}, "SERVICE_BUCKETS: not valid JSON", "1,2,4"),
        ({"SERVICE_TLS_CERT_FILE": "no-cert.pem", "SERVICE_TLS_KEY_FILE": "no-key.pem"}, "SERVICE_TLS_CERT_FILE",
         "no-cert.pem"),
    ],
)
def test_serve_refuses_bad_settings_with_exit_2_and_one_error_line(tmp_path, environment, named, hidden):
    done = _serve(tmp_path, **environment)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and named in lines[0]
    assert "Traceback" not in done.stderr
    if hidden is not None:
        assert hidden not in done.stderr + done.stdout
    assert not (tmp_path / "models").exists()  # stopped before touching the store


# ------------------------------------------------------------------------------------ the list of settings


def test_the_settings_stay_few_and_documented():
    assert len(USER) <= 23, USER  # 23: SERVICE_SHARED_MEMORY_MB, an operator's switch for a same-host extension
    assert len(ADVANCED) <= 11, ADVANCED  # 11: SERVICE_SHARED_MEMORY_REMOTE, an opt-in for a rare deployment
    assert set(USER) | set(ADVANCED) == set(ServiceSettings.model_fields)
    assert not set(USER) & set(ADVANCED)
    undocumented = [name for name, field in ServiceSettings.model_fields.items() if not field.description]
    assert undocumented == []


# ------------------------------------------------------------------------------------ shared bounds


@pytest.mark.parametrize(
    ("model_field", "settings_field", "refused", "edge"),
    [
        ("max_batch_size", "max_batch_size", [0, 4097], 4096),
        ("max_delay_ms", "max_delay_ms", [-0.5, 1000.5], 1000.0),
        ("queue_size", "queue_size", [0, 1_000_001], 1_000_000),
        ("timeout_s", "request_timeout_s", [0, 3600.5], 3600.0),
        ("precision", "precision", ["int8"], "auto"),
        ("buckets", "buckets", [(), tuple(range(1, MAX_BUCKETS + 2))], tuple(range(1, MAX_BUCKETS + 1))),
        ("buckets", "buckets", [(0, 4), (8, 4097)], (1, 4096)),
    ],
)
def test_model_config_and_settings_share_each_bound(model_field, settings_field, refused, edge):
    for value in refused:
        with pytest.raises(ValidationError):
            ModelConfig(**{model_field: value})
        with pytest.raises(ValidationError):
            ServiceSettings(**{settings_field: value})
    assert getattr(ModelConfig(**{model_field: edge}), model_field) == edge
    assert getattr(ServiceSettings(**{settings_field: edge}), settings_field) == edge


def test_the_default_model_is_the_demo_and_a_model_name():
    from service.registry.acceptance import MODEL_NAME_PATTERN
    from service.registry.manager import DEMO_MODEL

    field = ServiceSettings.model_fields["default_model"]
    assert field.default == DEMO_MODEL
    assert [getattr(item, "pattern", None) for item in field.metadata if getattr(item, "pattern", None)] == [
        MODEL_NAME_PATTERN]
    assert load_settings(default_model="").default_model is None
    assert load_settings(default_model="resnet18").default_model == "resnet18"
    with pytest.raises(SettingsError, match="SERVICE_DEFAULT_MODEL"):
        load_settings(default_model="../etc")
