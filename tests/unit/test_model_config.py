"""Per-model configuration: unsafe values refused, merge with the service defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.model_config import ModelConfig
from service.registry.version_engines import engine_options
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



def test_an_unset_tolerance_is_left_to_the_graphs_precision_through_the_sandbox_command_line():
    from service.model_config import VerifyTolerance
    from service.registry.sandbox import _tolerance_argv

    settings = ServiceSettings(_env_file=None)
    base = ModelConfig().effective(settings)
    assert base.verify_tolerance is None and "verify_tolerance" not in base.graph_fields()
    assert ModelConfig(verify_tolerance=VerifyTolerance()).effective(settings).verify_tolerance is None  # {}: unset
    assert _tolerance_argv(base.verify_tolerance) == []  # the child then takes the graph's precision's default
    own = ModelConfig(verify_tolerance=VerifyTolerance(rtol=1e-3)).effective(settings)
    assert own.graph_fields()["verify_tolerance"] == {"rtol": 1e-3}
    assert own.to_dict()["verify_tolerance"] == {"rtol": 1e-3, "atol": None}
    assert _tolerance_argv(own.verify_tolerance) == ["--rtol", "0.001"]
    # the fp32 default's figures, given by the user: the user's (an fp16 graph is then held to them)
    given = ModelConfig(verify_tolerance=VerifyTolerance(rtol=1e-4, atol=1e-5)).effective(settings)
    assert given.graph_fields() != base.graph_fields()
    assert _tolerance_argv(given.verify_tolerance) == ["--rtol", "0.0001", "--atol", "1e-05"]


# ---------------------------------------------------------------- image models
def test_an_image_config_round_trips_with_its_null_fields():
    from service.imaging import Postprocess, Preprocess

    config = ModelConfig(preprocess=Preprocess(resize=None, crop=(8, 8), layout="NHWC"),
                         postprocess=Postprocess(labels=("a", "b"), top_k=1), description="two classes")
    stored = config.to_dict()
    assert stored["preprocess"]["resize"] is None  # "no resize", not the default 256
    assert stored["postprocess"] == {"softmax": True, "top_k": 1, "labels": ["a", "b"]}
    assert ModelConfig.from_dict(stored) == config


def test_the_folded_normalisation_is_part_of_the_cache_key_only_when_there_is_one():
    from service.imaging import Postprocess, Preprocess

    settings = ServiceSettings(_env_file=None, fused_conv=True, verify=True)
    before = {"fused_conv": True, "verify": True}  # what every store written before image models holds
    assert ModelConfig().effective(settings).graph_fields() == before
    assert ModelConfig(postprocess=Postprocess()).effective(settings).graph_fields() == before
    assert ModelConfig(preprocess=Preprocess(wire_dtype="float32")).effective(settings).graph_fields() == before
    uint8 = ModelConfig(preprocess=Preprocess()).effective(settings).graph_fields()
    assert uint8["input_normalization"]["wire_dtype"] == "uint8"
    nhwc = ModelConfig(preprocess=Preprocess(layout="NHWC")).effective(settings).graph_fields()
    other_std = ModelConfig(preprocess=Preprocess(std=(0.5,))).effective(settings).graph_fields()
    same_graph = ModelConfig(preprocess=Preprocess(crop=(200, 200), channel_order="BGR")).effective(settings)
    assert len({repr(f) for f in (uint8, nhwc, other_std)}) == 3
    assert same_graph.graph_fields() == uint8  # crop and channel order change no graph


def test_labels_from_a_file_merge_into_the_postprocess_once():
    from service.imaging import Postprocess

    config = ModelConfig(postprocess=Postprocess(top_k=2)).with_labels(("x", "y"))
    assert config.postprocess == Postprocess(top_k=2, labels=("x", "y"))
    assert ModelConfig().with_labels(("x",)).postprocess == Postprocess(labels=("x",))
    with pytest.raises(ValueError, match="twice"):
        config.with_labels(("x", "y"))
    with pytest.raises(ValidationError, match="label 1"):
        ModelConfig().with_labels(("x", ""))


def test_triton_configs_as_grpc_json_writes_them_are_read():
    """tritonclient.grpc's ``get_model_config(as_json=True)`` writes uint64 as strings; a model without a batch
    dimension shows max_batch_size 0 (the default here); a hand-written parameter may be a bare string."""
    grpc_json = {"name": "m", "platform": "onnxruntime_onnx", "max_batch_size": 0,
                 "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["3"]}],
                 "dynamic_batching": {"max_queue_delay_microseconds": "1500"},
                 "parameters": {"buckets": {"string_value": "[1, 8]"}, "description": {"string_value": "plain text"}}}
    config = ModelConfig.model_validate(grpc_json)
    assert (config.max_batch_size, config.max_delay_ms, config.buckets) == (None, 1.5, (1, 8))
    assert config.description == "plain text"


def test_tritonclient_grpcs_config_wrapper_is_read_and_nothing_beside_it():
    """``get_model_config(as_json=True)`` over gRPC gives ``{"config": {...}}``: the config inside is read; the
    wrapper with anything else beside it, or around no object, is an unknown key as before."""
    inner = {"name": "m", "max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": "300"}}
    config = ModelConfig.model_validate({"config": inner})
    assert (config.max_batch_size, config.max_delay_ms) == (4, 0.3)
    for wrapped in ({"config": inner, "queue_size": 3}, {"config": 4}):
        with pytest.raises(ValidationError, match="config"):
            ModelConfig.model_validate(wrapped)
