"""The fused-op variant on the serving path, with the library's CPU kernels (the CUDA side: bench/fused_ops.py and
tests/gpu): the optimizer child makes and verifies it, the engine registers the library for it, the tuner
offers it only on a GPU, NCHW fp32, right after the first configuration, and checks it before timing it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest

from kernels import graphs
from service.errors import EngineError, VerificationError
from service.optimizer import OptimizerConfig, optimize
from service.optimizer.fused_ops import fused_op_count, lower_verified
from service.registry import variants as made_variants
from service.runtime import tuner
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config, configs_for
from service.runtime.engine import OrtEngine, random_feeds
from service.settings import ServiceSettings

SE = graphs.SeSpec(16, 6, 6, 8)
CPU = EngineOptions(device="cpu", buckets=(1, 2))


def block_model() -> onnx.ModelProto:
    """Two squeeze-excitation blocks written in standard ONNX operators (what the SE pass matches)."""
    return graphs.se_model(SE, copies=2)


def options(**changes) -> dict:
    return {"verify": True, "rtol": None, "atol": None, "input_normalization": None, **changes}


def test_the_child_makes_and_verifies_the_lowered_variant(cpu_library: Path, tmp_path: Path) -> None:
    model = block_model()
    _, made = made_variants.optimize_variants(model, frozenset({"plain", "onnxcnn"}),
                                              options(fused_ops_library=str(cpu_library)), tmp_path)
    assert set(made) == {"plain", "onnxcnn"}
    lowered = onnx.load(tmp_path / made["onnxcnn"]["file"])
    assert fused_op_count(lowered) == 2
    report = made["onnxcnn"]["report"]
    assert report["verified"] and report["max_abs_diff"] is not None
    assert report["nodes_after"] < made["plain"]["report"]["nodes_after"]
    assert {p["name"] for p in report["passes"]} >= {"fuse_se_block_into_fused_op", "fuse_dwconv_act_into_fused_op"}


def test_without_the_library_or_the_variant_nothing_is_lowered(cpu_library: Path, tmp_path: Path) -> None:
    model = block_model()
    _, made = made_variants.optimize_variants(model, frozenset({"plain", "onnxcnn"}), options(), tmp_path / "a")
    assert set(made) == {"plain"}
    _, made = made_variants.optimize_variants(model, frozenset({"plain"}),
                                              options(fused_ops_library=str(cpu_library)), tmp_path / "b")
    assert set(made) == {"plain"}


@pytest.fixture(autouse=True)
def _dirs(tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()


def test_a_graph_with_nothing_to_lower_gets_no_variant(cpu_library: Path, tmp_path: Path) -> None:
    model = graphs.dwconv_model(graphs.DwSpec(8, 9, 9, 3, 3, "Relu"))  # stride 3: no kernel for it
    _, made = made_variants.optimize_variants(model, frozenset({"plain", "onnxcnn"}),
                                              options(fused_ops_library=str(cpu_library)), tmp_path)
    assert set(made) == {"plain"}
    assert not (tmp_path / made_variants.KERNELS_FILE).exists()


def test_a_lowering_that_does_not_verify_is_left_out_with_its_reason(
    cpu_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrong(*_args, **_kwargs):
        raise VerificationError("output y: max |diff| 3 at [0, 1, 2, 3]")

    monkeypatch.setattr("service.optimizer.fused_ops.lower_verified", wrong)
    _, made = made_variants.optimize_variants(block_model(), frozenset({"plain", "onnxcnn"}),
                                              options(fused_ops_library=str(cpu_library)), tmp_path)
    assert made["onnxcnn"] == {"skipped": "output y: max |diff| 3 at [0, 1, 2, 3]"}
    assert not (tmp_path / made_variants.KERNELS_FILE).exists()


def test_verification_catches_a_wrong_lowering(cpu_library: Path) -> None:
    """The proof is against the original: a lowered graph with a changed weight fails it."""
    model = block_model()
    config = OptimizerConfig(fused_conv=False)
    plain, report = optimize(model, config)
    lowered, _ = lower_verified(model, plain, report, config, str(cpu_library))
    broken = onnx.ModelProto()
    broken.CopyFrom(plain)
    weight = broken.graph.initializer[0]
    values = onnx.numpy_helper.to_array(weight) * 1.5
    weight.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), weight.name))
    with pytest.raises(VerificationError):
        lower_verified(model, broken, report, config, str(cpu_library))
    assert fused_op_count(lowered) == 2


def test_the_engine_registers_the_library_for_a_lowered_model(cpu_library: Path) -> None:
    model = block_model()
    config = OptimizerConfig(fused_conv=False)
    plain, report = optimize(model, config)
    lowered, _ = lower_verified(model, plain, report, config, str(cpu_library))
    with OrtEngine.load(plain, CPU) as reference, \
            OrtEngine.load(lowered, CPU.replace(fused_ops_library=str(cpu_library))) as engine:
        feeds = random_feeds(reference.signature.inputs, 2, np.random.default_rng(3))
        want, got = reference.run(feeds), engine.run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
    with pytest.raises(EngineError, match="SERVICE_FUSED_OPS_LIBRARY"):
        OrtEngine.load(lowered, CPU)


def lowered_candidates(library: Path) -> dict[str, onnx.ModelProto]:
    model = block_model()
    config = OptimizerConfig(fused_conv=False)
    plain, report = optimize(model, config)
    lowered, _ = lower_verified(model, plain, report, config, str(library))
    return {"plain": plain, "onnxcnn": lowered}


def test_the_tuner_times_the_lowered_variant_nchw_fp32_second(cpu_library: Path) -> None:
    candidates = lowered_candidates(cpu_library)
    gpu = EngineOptions(device="cuda", buckets=(1, 64))
    configs = configs_for(candidates, gpu, "auto")
    keys = [c.key for c in configs]
    graphs_timed = [k for k in keys if not k.endswith("/no-graph")]  # the large-batch ones interleave
    # no conv-bias fusion in NCHW: beside the fused operators it computed garbage on the H200 (cuda_configs)
    assert graphs_timed[:3] == ["plain/nhwc/fp32", "onnxcnn/nchw/fp32", "plain/nhwc/fp32/conv-bias-fused"]
    assert not [k for k in keys if k.startswith("onnxcnn/") and ("nhwc" in k or "fp16" in k or "no-graph" in k)]
    assert any(k.startswith("plain/nhwc/fp16") for k in keys)  # fp16 still converts plain


def test_the_lowered_variant_is_checked_against_the_cpu_provider_before_timing(cpu_library: Path) -> None:
    candidates = lowered_candidates(cpu_library)
    settings = CPU.replace(fused_ops_library=str(cpu_library)).to_dict()
    config = dataclasses.asdict(Config("onnxcnn", None, "fp32"))
    outcome = tuner._time_config_child(candidates["onnxcnn"].SerializeToString(), settings, config, False)
    assert outcome["fused_ops_check"]["ok"] and outcome["fused_ops_check"]["rel_l2"] < 1e-5
    assert "timing" in outcome


def test_the_variant_is_choosable_on_a_gpu_only_where_the_library_loads(
    cpu_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuner, "gpu_name", lambda _ordinal: "GPU X")
    gpu = EngineOptions(device="auto")
    assert tuner.choosable_variants(gpu) == {"plain"}
    assert tuner.choosable_variants(gpu.replace(fused_ops_library=str(cpu_library))) == {"plain", "onnxcnn"}
    bogus = cpu_library.parent / "not-a-library.so"
    bogus.write_bytes(b"not an ELF file")
    assert tuner.choosable_variants(gpu.replace(fused_ops_library=str(bogus))) == {"plain"}
    assert "onnxcnn" not in tuner.choosable_variants(EngineOptions(device="cpu",
                                                                   fused_ops_library=str(cpu_library)))


def test_the_setting_names_the_library(cpu_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServiceSettings(fused_ops_library="off").fused_ops_library_file is None
    assert ServiceSettings(fused_ops_library=str(cpu_library)).fused_ops_library_file == str(cpu_library)
    monkeypatch.setattr("service.settings.BUILT_FUSED_OPS", tmp_path / "libonnxcnn_ops.so")
    assert ServiceSettings().fused_ops_library_file is None
    (tmp_path / "libonnxcnn_ops.so").write_bytes(b"x")
    assert ServiceSettings().fused_ops_library_file == str(tmp_path / "libonnxcnn_ops.so")
    with pytest.raises(ValueError, match="auto, off, or the path"):
        ServiceSettings(fused_ops_library=str(tmp_path / "missing.so"))


def test_a_lowered_variant_is_not_served_on_the_cpu_or_without_the_library(cpu_library: Path) -> None:
    candidates = lowered_candidates(cpu_library)
    engine, record = tuner.select_variant(candidates, CPU.replace(fused_ops_library=str(cpu_library)), budget_s=0)
    with engine:
        assert record["choice"]["variant"] == "plain"
    gpu = EngineOptions(device="cuda")
    assert set(tuner._servable(candidates, gpu, cuda=True)) == {"plain"}
    assert set(tuner._servable(candidates, gpu.replace(fused_ops_library=str(cpu_library)), cuda=True)) == {
        "plain", "onnxcnn"}


def test_a_library_that_does_not_load_costs_the_variant_not_the_upload(tmp_path: Path) -> None:
    bogus = tmp_path / "libonnxcnn_ops.so"
    bogus.write_bytes(b"not an ELF file")
    (tmp_path / "out").mkdir()
    _, made = made_variants.optimize_variants(block_model(), frozenset({"plain", "onnxcnn"}),
                                              options(fused_ops_library=str(bogus)), tmp_path / "out")
    assert set(made) == {"plain", "onnxcnn"} and "file" in made["plain"]
    assert "does not load" in made["onnxcnn"]["skipped"]


def test_an_engine_whose_library_does_not_load_says_so(cpu_library: Path, tmp_path: Path) -> None:
    candidates = lowered_candidates(cpu_library)
    bogus = tmp_path / "libonnxcnn_ops.so"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(EngineError, match="the model needs the fused-op library, which does not load"):
        OrtEngine.load(candidates["onnxcnn"], CPU.replace(fused_ops_library=str(bogus)))
