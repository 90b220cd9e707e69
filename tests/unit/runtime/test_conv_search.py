"""Which cuDNN search a served CUDA session gets (``runtime.conv_search``): the noise rule, the record entry, its
use, and the tuner around it. No GPU here: the comparison's child is faked where its answer matters, and run
for real on the CPU provider where its shape matters (the search setting changes nothing on the CPU)."""

from __future__ import annotations

from typing import Any

import onnx
import onnxruntime as ort
import pytest
from engine_models import conv_relu_net
from fake_gpu import FakeChildren, believe_gpu

from service.runtime import conv_search, tuner
from service.runtime.child import ChildProcessFailed
from service.runtime.contract import EngineOptions
from service.runtime.cuda_configs import Config

CONFIG = Config("plain", True, "fp32", False)
AUTO = EngineOptions(device="cpu", buckets=(1, 2, 4), cudnn_conv_algo_search="auto", tune_budget_s=30.0)


@pytest.fixture(scope="module")
def candidates() -> dict[str, onnx.ModelProto]:
    return {"fused": conv_relu_net(fused=True), "plain": conv_relu_net(fused=False)}


def search(record: dict[str, Any] | None, options: EngineOptions = AUTO) -> str:
    """The search ``served_search`` resolves for CONFIG."""
    return conv_search.served_search(record, CONFIG, options).cudnn_conv_algo_search


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


def test_a_session_is_built_with_the_verdict_for_its_configuration_else_the_cheap_search() -> None:
    measured = {"cudnn_conv_algo_search": {"config": CONFIG.key, "choice": "EXHAUSTIVE", "measured": True}}
    assert search(measured) == "EXHAUSTIVE"
    other = {"cudnn_conv_algo_search": {"config": "plain/nchw/fp32", "choice": "EXHAUSTIVE", "measured": True}}
    assert search(other) == "HEURISTIC"  # a verdict for another configuration says nothing of this one
    assert search(None) == search({}) == "HEURISTIC"
    unmeasured = {"cudnn_conv_algo_search": conv_search.unmeasured(CONFIG, "served at once")}
    assert search(unmeasured) == "HEURISTIC" and unmeasured["cudnn_conv_algo_search"]["measured"] is False


def test_an_explicit_setting_is_used_as_set() -> None:
    measured = {"cudnn_conv_algo_search": {"config": CONFIG.key, "choice": "HEURISTIC", "measured": True}}
    for setting in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"):
        options = AUTO.replace(cudnn_conv_algo_search=setting)
        assert conv_search.served_search(measured, CONFIG, options) is options


def test_a_comparison_times_every_served_bucket_in_a_child(
    candidates: dict[str, onnx.ModelProto], children: list
) -> None:
    entry = conv_search.measure(CONFIG, candidates["plain"], AUTO)
    assert entry["config"] == CONFIG.key and entry["choice"] == "HEURISTIC" and entry["measured"] is True
    assert set(entry["timings_ms"]["HEURISTIC"]) == {"1", "2", "4"}  # every served bucket
    assert children == [(CONFIG.key, AUTO.to_dict())]


def test_a_failed_comparison_serves_the_cheap_search_and_says_why(
    candidates: dict[str, onnx.ModelProto], monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(fn, args, *, timeout_s, cancel=None):
        raise ChildProcessFailed("the child process died (exit code -6)")

    monkeypatch.setattr(conv_search, "run_in_child", crash)
    entry = conv_search.measure(CONFIG, candidates["plain"], AUTO)
    assert entry["choice"] == "HEURISTIC" and "comparison failed" in entry["reason"]
    assert "exit code -6" in entry["reason"]
    assert search({"cudnn_conv_algo_search": entry}) == "HEURISTIC"


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
    """The tuner believes it runs on "GPU X"; its timing children are faked (the engines still load on the CPU),
    and every load records the search it was built with."""
    seen: dict[str, list] = {"ranked_with": [], "served_with": []}
    believe_gpu(monkeypatch)
    fake = FakeChildren()

    def timing_child(fn, args, *, timeout_s, cancel=None):
        seen["ranked_with"].append(args[1]["cudnn_conv_algo_search"])
        return fake(fn, args, timeout_s=timeout_s, cancel=cancel)

    real_load = tuner.load_config

    def recording_load(model, config, settings):
        seen["served_with"].append(settings.cudnn_conv_algo_search)
        return real_load(model, config, settings)

    monkeypatch.setattr(tuner, "run_in_child", timing_child)
    monkeypatch.setattr(tuner, "load_config", recording_load)
    return seen


def test_the_tuner_compares_the_winners_searches_last_and_a_restart_builds_the_verdict(
    candidates: dict[str, onnx.ModelProto], fake_gpu: dict[str, list], children: list
) -> None:
    options = AUTO.replace(buckets=(1, 4))
    first = tuner.serve_first(candidates, options, precision="fp32")
    first.engine.close()
    assert fake_gpu["served_with"] == ["HEURISTIC"] and fake_gpu["ranked_with"] == []  # serves at once
    assert first.record["cudnn_conv_algo_search"]["measured"] is False
    assert first.plan is not None
    record = tuner.tune(first.plan).record
    assert set(fake_gpu["ranked_with"]) == {"HEURISTIC"}  # candidates timed with the cheap search
    chosen = Config(**record["choice"]).key
    assert record["cudnn_conv_algo_search"]["config"] == chosen and [c[0] for c in children] == [chosen]
    assert record["device"] == "GPU X" and record["ort_version"] == ort.__version__
    verdict = {**record, "proven": True,
               "cudnn_conv_algo_search": {**record["cudnn_conv_algo_search"], "choice": "EXHAUSTIVE"}}
    fake_gpu["ranked_with"].clear()
    again = tuner.serve_first(candidates, options, precision="fp32", cached_records=(verdict,))
    again.engine.close()
    assert again.record["reused"] is True and fake_gpu["ranked_with"] == [] and len(children) == 1
    assert fake_gpu["served_with"][-1] == "EXHAUSTIVE"
