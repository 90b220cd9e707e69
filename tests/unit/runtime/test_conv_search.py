"""Which cuDNN search a served CUDA session gets (``runtime.conv_search``): the noise rule, the record entry, its
reuse, and the tuner around it. No GPU here: the comparison's child is faked where its answer matters, and run
for real on the CPU provider where its shape matters (the search setting changes nothing on the CPU)."""

from __future__ import annotations

from typing import Any

import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net

from service.runtime import conv_search, tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config
from service.runtime.device import CUDA, DeviceChoice

CONFIG = Config("plain", True, "fp32", False)
AUTO = EngineOptions(device="cpu", buckets=(1, 2, 4), cudnn_conv_algo_search="auto", tune_budget_s=30.0)


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


def search(record: dict[str, Any], model: onnx.ModelProto, budget_s: float) -> str:
    """The search ``served_options`` resolves for CONFIG under "auto"."""
    return conv_search.served_options(record, CONFIG, model, AUTO, budget_s).cudnn_conv_algo_search


def timings(heuristic: dict[str, float], exhaustive: dict[str, float]) -> dict[str, dict[str, float]]:
    return {"HEURISTIC": heuristic, "EXHAUSTIVE": exhaustive}


# ------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("heuristic", "exhaustive", "served"),
    [
        ({"1": 0.500, "64": 4.00}, {"1": 0.500, "64": 4.00}, "HEURISTIC"),  # equal
        ({"1": 0.514, "64": 4.00}, {"1": 0.500, "64": 4.00}, "HEURISTIC"),  # +2.8 %: within noise
        ({"1": 0.480, "64": 3.50}, {"1": 0.500, "64": 4.00}, "HEURISTIC"),  # the cheap search is faster
        ({"1": 0.500, "64": 4.20}, {"1": 0.500, "64": 4.00}, "EXHAUSTIVE"),  # +5 % at one bucket decides
        ({"1": 0.520, "64": 3.00}, {"1": 0.500, "64": 4.00}, "EXHAUSTIVE"),  # +4 % at b1, whatever b64 gains
    ],
)
def test_heuristic_is_served_unless_exhaustive_is_faster_beyond_noise_at_some_bucket(
    heuristic: dict[str, float], exhaustive: dict[str, float], served: str
) -> None:
    choice, reason = conv_search.verdict(timings(heuristic, exhaustive))
    assert choice == served
    assert ("slower beyond 3%" in reason) is (served == "EXHAUSTIVE")


def test_the_rule_needs_a_bucket_timed_with_both() -> None:
    with pytest.raises(ValueError, match="no bucket"):
        conv_search.verdict(timings({"1": 1.0}, {"64": 1.0}))


def test_auto_ranks_the_candidates_with_the_cheap_search_and_a_setting_stays_as_set() -> None:
    assert conv_search.ranking_options(AUTO).cudnn_conv_algo_search == "HEURISTIC"
    for search in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"):
        assert conv_search.ranking_options(AUTO.replace(cudnn_conv_algo_search=search)).cudnn_conv_algo_search == search
    assert AUTO.conv_search == "EXHAUSTIVE"  # "auto" left undecided builds what ORT defaults to


# ------------------------------------------------------------------------------------------- the entry
@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The comparison's child, faked: HEURISTIC 2 % slower at every bucket (within noise). Records each call."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake_child(fn, args, *, timeout_s, cancel=None):
        calls.append((Config(**args[2]).key, args[1]))
        buckets = [str(b) for b in args[1]["buckets"]]
        return {"timings_ms": timings({b: 1.02 for b in buckets}, dict.fromkeys(buckets, 1.0)),
                "warm_s": {"HEURISTIC": {"1": 0.1}, "EXHAUSTIVE": {"1": 2.0}}, "session_s": {}}

    monkeypatch.setattr(conv_search, "run_in_child", fake_child)
    return calls


@pytest.fixture
def files(candidates: dict[str, onnx.ModelProto], tmp_path) -> dict[str, str]:
    """The optimized variants as a load request names them."""
    paths = {}
    for name, model in candidates.items():
        onnx.save(model, tmp_path / f"{name}.onnx")
        paths[name] = str(tmp_path / f"{name}.onnx")
    return paths


def test_auto_serves_the_cheap_search_at_once_and_compares_once_the_model_serves(
    candidates: dict[str, onnx.ModelProto], children: list, files: dict[str, str]
) -> None:
    record: dict[str, Any] = {"choice": CONFIG.to_dict()}
    served = conv_search.served_options(record, CONFIG, candidates["plain"], AUTO, budget_s=30.0)
    assert served.cudnn_conv_algo_search == "HEURISTIC" and served.buckets == AUTO.buckets
    assert conv_search.pending(record) and children == []  # the start waits for no comparison
    measured = conv_search.measure_pending(record, files, AUTO)
    entry = measured["cudnn_conv_algo_search"]
    assert entry["config"] == CONFIG.key and entry["choice"] == "HEURISTIC" and entry["measured"] is True
    assert set(entry["timings_ms"]["HEURISTIC"]) == {"1", "2", "4"}  # every served bucket
    assert children == [(CONFIG.key, AUTO.to_dict())] and not conv_search.pending(measured)
    again = conv_search.served_options(dict(measured), CONFIG, candidates["plain"], AUTO, budget_s=30.0)
    assert again.cudnn_conv_algo_search == "HEURISTIC" and len(children) == 1  # reused: nothing measured


def test_a_verdict_for_another_configuration_is_measured_again(
    candidates: dict[str, onnx.ModelProto], children: list
) -> None:
    record = {"cudnn_conv_algo_search": {"config": "plain/nchw/fp32", "choice": "EXHAUSTIVE", "measured": True}}
    served = conv_search.served_options(record, CONFIG, candidates["plain"], AUTO, budget_s=30.0)
    assert served.cudnn_conv_algo_search == "HEURISTIC" and conv_search.pending(record)
    assert record["cudnn_conv_algo_search"]["config"] == CONFIG.key


def test_an_explicit_setting_is_used_as_set_and_measures_nothing(
    candidates: dict[str, onnx.ModelProto], children: list
) -> None:
    measured = {"cudnn_conv_algo_search": {"config": CONFIG.key, "choice": "HEURISTIC", "measured": True}}
    for search in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"):
        record = dict(measured)
        options = AUTO.replace(cudnn_conv_algo_search=search)
        assert conv_search.served_options(record, CONFIG, candidates["plain"], options, budget_s=30.0) is options
        assert record == measured  # the measured verdict stays for when the setting goes back to auto
    assert children == []


def test_a_zero_budget_serves_the_cheap_search_unmeasured_and_a_budget_measures_it_later(
    candidates: dict[str, onnx.ModelProto], children: list
) -> None:
    record: dict[str, Any] = {}
    assert search(record, candidates["plain"], 0.0) == "HEURISTIC"
    assert record["cudnn_conv_algo_search"]["measured"] is False and not conv_search.pending(record)
    assert search(record, candidates["plain"], 0.0) == "HEURISTIC"
    assert children == []
    conv_search.served_options(record, CONFIG, candidates["plain"], AUTO, 30.0)
    assert conv_search.pending(record) and children == []  # a budget: compared once the model serves


def test_a_failed_comparison_serves_the_cheap_search_and_is_not_repeated(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch, files: dict[str, str]
) -> None:
    calls = []

    def crash(fn, args, *, timeout_s, cancel=None):
        calls.append(args)
        raise ChildProcessFailed("the child process died (exit code -6)")

    monkeypatch.setattr(conv_search, "run_in_child", crash)
    record: dict[str, Any] = {"choice": CONFIG.to_dict()}
    assert search(record, candidates["plain"], 30.0) == "HEURISTIC"
    record = conv_search.measure_pending(record, files, AUTO)
    assert "comparison failed" in record["cudnn_conv_algo_search"]["reason"] and "exit code -6" in str(record)
    assert search(record, candidates["plain"], 30.0) == "HEURISTIC" and not conv_search.pending(record)
    assert len(calls) == 1


def test_the_comparison_child_times_both_searches_at_every_bucket(candidates: dict[str, onnx.ModelProto]) -> None:
    """The child's body, run here on the CPU provider (where the search setting changes nothing)."""
    outcome = conv_search.compare_child(candidates["plain"].SerializeToString(), AUTO.to_dict(),
                                        Config("plain", None, "fp32").to_dict())
    assert set(outcome["timings_ms"]) == {"HEURISTIC", "EXHAUSTIVE"}
    for search in ("HEURISTIC", "EXHAUSTIVE"):
        assert set(outcome["timings_ms"][search]) == {"1", "2", "4"}
        assert all(ms > 0 for ms in outcome["timings_ms"][search].values())
        assert outcome["session_s"][search] > 0 and outcome["warm_s"][search]
    choice, _ = conv_search.verdict(outcome["timings_ms"])
    assert choice in ("HEURISTIC", "EXHAUSTIVE")


# ------------------------------------------------------------------------------------------- the tuner
@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """select_variant believes it runs on "GPU X"; the timing children are faked (the engines still load on
    the CPU), and every load records the search it was built with."""
    seen: dict[str, list] = {"ranked_with": [], "served_with": []}

    def fake_timing_child(fn, args, *, timeout_s):
        seen["ranked_with"].append(args[1]["cudnn_conv_algo_search"])
        return {"timing": {"1": 1.0, "4": 2.0}}

    real_load = tuner._load

    def recording_load(cands, config, settings):
        seen["served_with"].append(settings.cudnn_conv_algo_search)
        return real_load(cands, config, settings.replace(device="cpu"))

    monkeypatch.setattr(tuner, "resolve_device", lambda options: DeviceChoice(CUDA, 0, "a fake GPU"))
    monkeypatch.setattr(tuner, "gpu_name", lambda device_id=0: "GPU X")
    monkeypatch.setattr(tuner, "run_in_child", fake_timing_child)
    monkeypatch.setattr(tuner, "_load", recording_load)
    return seen


def test_the_tuner_records_the_verdict_and_a_restart_reuses_it_without_measuring(
    candidates: dict[str, onnx.ModelProto], fake_gpu: dict[str, list], children: list, files: dict[str, str]
) -> None:
    options = AUTO.replace(buckets=(1, 4))
    engine, record = tuner.select_variant(candidates, options, precision="fp32")
    engine.close()
    assert set(fake_gpu["ranked_with"]) == {"HEURISTIC"}  # candidates timed with the cheap search
    assert fake_gpu["served_with"] == ["HEURISTIC"]
    chosen = Config(**record["choice"]).key
    assert conv_search.pending(record) and children == []
    record = conv_search.measure_pending(record, files, options)  # what the registry runs once it serves
    assert record["cudnn_conv_algo_search"]["config"] == chosen and [c[0] for c in children] == [chosen]
    assert record["device"] == "GPU X" and record["ort_version"] == ort.__version__
    fake_gpu["ranked_with"].clear()
    engine, reused = tuner.select_variant(candidates, options, precision="fp32", cached_choice=record)
    engine.close()
    assert reused["reused"] is True and fake_gpu["ranked_with"] == [] and len(children) == 1
    assert fake_gpu["served_with"] == ["HEURISTIC", "HEURISTIC"]


def test_a_record_without_a_verdict_is_compared_once_its_model_serves(
    candidates: dict[str, onnx.ModelProto], fake_gpu: dict[str, list], children: list, files: dict[str, str]
) -> None:
    """A record made before the comparison existed (or under an explicit setting) keeps its choice; the
    search is measured for it once, and the record says so from then on."""
    old = {"choice": CONFIG.to_dict(), "device": "GPU X", "ort_version": ort.__version__, "timings_ms": {}}
    engine, record = tuner.select_variant(candidates, AUTO, precision="fp32", cached_choice=old)
    engine.close()
    assert record["reused"] is True and fake_gpu["ranked_with"] == []
    assert conv_search.pending(record) and children == []
    record = conv_search.measure_pending(record, files, AUTO)
    assert [c[0] for c in children] == [CONFIG.key] and record["cudnn_conv_algo_search"]["choice"] == "HEURISTIC"
