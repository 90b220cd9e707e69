"""Per-model configuration: unsafe values refused, merge with the service defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.model_config import ModelConfig
from service.registry.manager import engine_options
from service.settings import MAX_BUCKETS, ServiceSettings


@pytest.mark.parametrize(
    "fields",
    [
        {"max_batch_size": 0},
        {"max_batch_size": 5000},
        {"max_delay_ms": -1},
        {"max_delay_ms": 5000},
        {"queue_size": 0},
        {"queue_size": 10**9},
        {"timeout_s": 0},
        {"timeout_s": 10**6},
        {"precision": "int8"},
        {"buckets": []},
        {"buckets": [0, 4]},
        {"buckets": [8, 8192]},
        {"buckets": list(range(1, MAX_BUCKETS + 2))},
        {"fused_conv": "maybe"},
        {"model_path": "/etc/passwd"},  # unknown fields are refused, never ignored
    ],
)
def test_unsafe_values_are_refused(fields):
    with pytest.raises(ValidationError):
        ModelConfig.model_validate(fields)


def test_unset_fields_follow_the_service_defaults():
    settings = ServiceSettings(
        _env_file=None,
        max_batch_size=32,
        max_delay_ms=4.0,
        queue_size=100,
        request_timeout_s=9.0,
        buckets=(1, 8, 32),
        fused_conv=False,
        verify=True,
        precision="fp16",
    )
    effective = ModelConfig().effective(settings)
    assert (effective.max_batch_size, effective.queue_size, effective.timeout_s) == (32, 100, 9.0)
    assert effective.max_delay_s == pytest.approx(0.004)
    assert (effective.precision, effective.buckets, effective.fused_conv, effective.verify) == (
        "fp16",
        (1, 8, 32),
        False,
        True,
    )
    assert engine_options(settings, effective).buckets == (1, 8, 32)


def test_set_fields_override_and_round_trip():
    config = ModelConfig(
        max_batch_size=8, max_delay_ms=0, buckets=(8, 1, 2, 2), precision="auto", fused_conv=True
    )
    assert config.buckets == (1, 2, 8)
    stored = config.to_dict()
    assert stored == {
        "max_batch_size": 8,
        "max_delay_ms": 0.0,
        "buckets": [1, 2, 8],
        "precision": "auto",
        "fused_conv": True,
    }
    assert ModelConfig.from_dict(stored) == config
    no_fusion = ServiceSettings(_env_file=None, fused_conv=False)
    effective = config.effective(no_fusion)
    assert (effective.max_batch_size, effective.max_delay_s, effective.precision) == (8, 0.0, "auto")
    assert effective.buckets == (1, 2, 8) and effective.fused_conv
    assert engine_options(ServiceSettings(_env_file=None), effective).buckets == (1, 2, 8)


def test_batching_switched_off_globally_means_one_request_per_call():
    settings = ServiceSettings(_env_file=None, max_batch_size=1)
    assert ModelConfig(max_batch_size=16).effective(settings).max_batch_size == 1


def test_graph_fields_change_only_with_what_changes_the_graph():
    settings = ServiceSettings(_env_file=None)
    base = ModelConfig().effective(settings).graph_fields()
    assert ModelConfig(max_batch_size=4, precision="fp16").effective(settings).graph_fields() == base
    flipped = ModelConfig(fused_conv=not settings.fused_conv)
    assert flipped.effective(settings).graph_fields() != base
