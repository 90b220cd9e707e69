"""The engine a GPU serves: one configuration at once, a faster one once the tuner found it and it proved itself here.

Why: a configuration chosen from a few timings in a child was trusted in the serving process, where some faulted
(CUDA 715 at the first request of 1 in 27 fresh starts on the H100, 4 in 21 on the H200) and some computed wrong
(ORT's NCHW conv-bias fusion on the H200); and the start waited for the tuner (39 s of 44 on the H100).

How (``SwitchingEngine``, what ``runtime.loading`` returns on CUDA):
* It serves what ``tuner.serve_first`` built: a proven record's configuration, or the default one.
* Once the served engine is warm, ``TuneJob`` runs ``tuner.tune`` in a thread of its own (the tuner's children do
  the GPU work, within ``tune_budget_s``); readiness never waits for it. Its refusals go to the store at once.
* When the tuner's winner is not what serves, the serving thread builds it between batches, one step per
  ``warm_next`` (``TunesWhileServing``: the job wakes whoever serves the engine): its sessions with their first
  buckets, then every other bucket (each capture checked against a plain run of fresh inputs,
  ``runtime.warming``), then the proof: the candidate against the serving engine on the requests served meanwhile
  (``SAMPLES``, recorded with their answers) and on fresh inputs at every bucket, within ``PROOF_REL_L2`` and the
  top-1 rule (``precision.agreement``: fp32 and fp16 alike). Only then does it serve, from the next batch on
  (no request is lost or answered twice); the old engine is closed, and the record, marked ``proven``, goes to the
  store (a restart builds it at once).
* A candidate that fails any step is refused store-wide with its reason (``runtime.tuner_faults``: GPU, ORT
  version, graph, library build) and the next fastest timed one is tried, ``MAX_ATTEMPTS`` in all; when the winner
  is what serves, the served record is proven as it is.
* A sticky CUDA error (``tuner_faults.is_gpu_fault``) is recorded against the configuration that met it, and from
  then on every call raises ``GpuFaultError`` without touching the device: the process's CUDA context is lost,
  and whoever serves the engine replaces it in another process (``registry.recovery``). Dead engines are never
  closed (a call into the lost context can abort the process).

Invariants: ``run_parts`` and ``warm_next`` are called by one thread, the serving one (ORT keeps CUDA graphs per
thread); the job thread only times in children, reports refusals and wakes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from service.errors import EngineError, GpuFaultError, first_line
from service.runtime import conv_search
from service.runtime.contract import PageLocker, random_feeds
from service.runtime.cuda_configs import Config, split_config
from service.runtime.device_rows import DeviceRows
from service.runtime.engine import OrtEngine
from service.runtime.loads import TuningReports
from service.runtime.precision import REL_L2_TOLERANCE, agreement
from service.runtime.split_engine import SplitEngine
from service.runtime.timing import score
from service.runtime.tuner import Identity, TuneOutcome, TuningPlan, load_record, tune
from service.runtime.tuner_faults import FAULT, MISMATCH, is_gpu_fault

logger = logging.getLogger(__name__)

SAMPLES = 4
"""Served requests kept (inputs and answers) while a switch may come, to prove the candidate on real inputs."""
SAMPLE_MAX_ROWS = 16
"""Larger batches are not kept (a copy of their inputs would cost the request more than it teaches)."""
MAX_ATTEMPTS = 2
"""Candidates built and proven in one process: the tuner's winner, then the next fastest timed one."""
PROOF_REL_L2 = 2 * REL_L2_TOLERANCE
"""The relative L2 distance allowed between the candidate's answer and the serving engine's: each is within
``REL_L2_TOLERANCE`` of the exact answer (the tuner checked the candidate against the CPU provider), so two can be
twice that apart. Measured: the fused operators against plain NHWC on the demo image model, 8.8e-2 at bucket 2
on dark pixels (0..3), both within 5e-2 of the CPU (H100, bench/results/coldstart-2026-12-06-h100.json); a
broken configuration lands near 1 or far above."""

Served = OrtEngine | SplitEngine


class TuneJob:
    """``tuner.tune`` in a thread of its own; ``outcome`` once ``done``. Refusals go to ``reports`` at once."""

    def __init__(self, plan: TuningPlan, reports: TuningReports | None, label: str) -> None:
        self._plan, self._reports, self._label = plan, reports, label
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.outcome: TuneOutcome | None = None
        self.error: str | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def done(self) -> bool:
        return self._done.is_set()

    def start(self, finished: Callable[[], None]) -> None:
        """Tune in the background; ``finished()`` once done (not after ``cancel``)."""
        self._thread = threading.Thread(target=self._run, args=(finished,), name=f"tune-{self._label}"[:40],
                                        daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Kill the child in flight and end the job (it calls nothing after)."""
        self._cancel.set()

    def _run(self, finished: Callable[[], None]) -> None:
        try:
            self.outcome = tune(self._plan, self._cancel)
            if self._reports is not None and self.outcome.refusals and not self._cancel.is_set():
                self._reports.refused(self.outcome.refusals)
        except Exception as exc:  # the version serves on regardless
            self.error = first_line(exc)
            logger.exception("autotune of %s failed; it serves its configuration on", self._label)
        finally:
            self._done.set()
        if not self._cancel.is_set():
            try:
                finished()
            except Exception:  # whoever served the engine stopped meanwhile
                logger.debug("autotune of %s: nobody to wake", self._label, exc_info=True)


@dataclasses.dataclass
class _Candidate:
    """A configuration being built and proven on the serving thread."""

    record: dict[str, Any]
    engine: Served | None = None

    @property
    def config(self) -> Config:
        return Config(**self.record["choice"])


class _Refused(Exception):
    """A candidate failed a step: ``config`` (the one that failed) is refused with ``kind`` and the message."""

    def __init__(self, config: Config, reason: str, kind: str = MISMATCH) -> None:
        super().__init__(reason)
        self.config, self.kind = config, kind


class SwitchingEngine:
    """Serves ``served`` (the configuration ``record`` names) and switches to what tuning ``plan`` finds, once
    proven (see the module docstring). ``candidates`` and ``identity`` name configurations in refusals."""

    max_concurrent_calls = 1

    def __init__(
        self, served: Served, record: dict[str, Any], *, candidates: Mapping[str, onnx.ModelProto],
        identity: Identity, plan: TuningPlan | None = None, reports: TuningReports | None = None, label: str = "",
    ) -> None:
        self._current = served
        self.record = record
        self._candidates, self._identity, self._plan, self._reports = candidates, identity, plan, reports
        self.label = label or served.variant
        self.signature = served.signature
        self.provider = served.provider
        self.max_batch_size = served.max_batch_size
        self.buckets = served.buckets
        self._job = TuneJob(plan, reports, self.label) if plan is not None else None
        self._candidate: _Candidate | None = None
        self._tried: set[str] = set()
        self._samples: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        self._wake: Callable[[], None] | None = None
        self._lost: str | None = None
        self._closed = False
        self.state = "tuning once warm" if plan is not None else "serving its record"

    # ------------------------------------------------------------------ the Engine protocol
    @property
    def variant(self) -> str:
        return self._current.variant

    @property
    def lost(self) -> str | None:
        """Why the CUDA context is lost (None while it serves)."""
        return self._lost

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_parts([feeds])

    def run_parts(self, parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The served engine's ``run_parts``; a sticky CUDA error is recorded and raised as GpuFaultError."""
        if self._lost is not None:
            raise GpuFaultError(f"the GPU's context is lost ({self._lost})")
        try:
            outputs = self._current.run_parts(parts)
        except EngineError as exc:
            if not is_gpu_fault(exc.message):
                raise
            rows = sum(self.signature.rows_of(part) for part in parts)
            self._fault(self._config_serving(rows), exc.message)
            raise GpuFaultError(f"the GPU faulted: {exc.message}") from exc
        if self._sampling():
            self._keep_sample(parts, outputs)
        return outputs

    def last_engine_seconds(self) -> float | None:
        return self._current.last_engine_seconds()

    def page_locker(self) -> PageLocker | None:
        return self._current.page_locker()

    @property
    def host_to_device(self) -> str:
        return self._current.host_to_device

    def replay(self, batch: int) -> None:
        self._current.replay(batch)

    def fill(self, batch: int) -> None:
        self._current.fill(batch)

    def bucket_for(self, n: int) -> int:
        return self._current.bucket_for(n)

    def describe(self) -> dict[str, Any]:
        return {**self._current.describe(), "tuning": self.state}

    def close(self) -> None:
        """Stop the tuning, close the candidate and the served engine (not after a fault: see the docstring)."""
        self._closed = True
        if self._job is not None:
            self._job.cancel()
        if self._lost is not None:
            return
        if self._candidate is not None and self._candidate.engine is not None:
            self._candidate.engine.close()
        self._current.close()

    def __enter__(self) -> SwitchingEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ work between batches
    def on_more_work(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def settle(self, timeout_s: float) -> None:
        """Every step on the calling thread, waiting for the tuning between, until nothing is left or
        ``timeout_s`` passed: what a server that served a while has (benchmarks time that)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.warm_next():
                continue
            if self._job is None or not self._job.started:
                return
            if not self._job.done():
                time.sleep(0.05)

    def warm_next(self) -> bool:
        """One step on the serving thread (True while more are ready): the served engine's next bucket, then the
        tuner's start, then the candidate's steps (see the module docstring)."""
        if self._closed or self._lost is not None:
            return False
        if self._current.warm_next():
            return True
        if self._candidate is not None:
            return self._candidate_step()
        if self._job is None:
            return False
        if not self._job.started:
            self.state = "tuning in the background"
            self._job.start(self._woken)
            return False
        if not self._job.done():
            return False
        job, self._job = self._job, None
        if job.outcome is None or job.outcome.config is None:
            why = job.error or (job.outcome.record.get("reason") if job.outcome is not None else "no outcome")
            self.state = f"tuning found nothing to switch to ({why})"
            return False
        return self._consider(job.outcome.record)

    def _woken(self) -> None:
        if self._wake is not None:
            self._wake()

    def _consider(self, record: dict[str, Any]) -> bool:
        """Start proving ``record`` (True), or prove what serves when it is the same (False)."""
        if _same_engine(record, self.record):
            self._prove_served(record)
            return False
        self._tried.add(Config(**record["choice"]).key)
        self._candidate = _Candidate(record)
        self.state = f"proving {self._candidate.config.key}"
        logger.info("engine %s: the tuner chose %s; building and proving it while %s serves", self.label,
                    self._candidate.config.key, self.variant)
        return True

    def _prove_served(self, record: dict[str, Any]) -> None:
        """The tuner's winner is what serves: its record, with the tuner's timings, is proven as it stands."""
        served = {**record, "proven": True, "reason": f"{record.get('reason')}; it was serving already",
                  "split": self.record.get("split"), "choice": self.record["choice"]}
        served = {k: v for k, v in served.items() if v is not None}
        self.record = served
        self.state = f"serving {Config(**served['choice']).key}, proven"
        self._report_proven(served)

    def _candidate_step(self) -> bool:
        candidate = self._candidate
        assert candidate is not None and self._plan is not None
        try:
            if candidate.engine is None:
                candidate.engine = self._build(candidate)
                return True
            if candidate.engine.warm_next():
                return True
            self._check_warm(candidate)
            self._prove(candidate)
        except _Refused as refused:
            return self._refuse(candidate, refused)
        except Exception as exc:
            text = first_line(exc, limit=300)
            if is_gpu_fault(text):
                self._fault(candidate.config, text)
                return False
            return self._refuse(candidate, _Refused(candidate.config, f"it failed here: {text}"))
        self._switch(candidate)
        return False

    def _build(self, candidate: _Candidate) -> Served:
        assert self._plan is not None
        return load_record(self._candidates, candidate.record, self._plan.settings)

    def _check_warm(self, candidate: _Candidate) -> None:
        """Every served bucket warmed (its capture replayed like a plain run of fresh inputs)."""
        engine = candidate.engine
        assert engine is not None
        for part, config in _parts(engine, candidate.record):
            missing = sorted(set(part.buckets) - set(part.warm_buckets))
            if missing:
                raise _Refused(config, f"buckets {missing} did not warm (their graph replay differed)")

    def _prove(self, candidate: _Candidate) -> None:
        """The candidate against the serving engine: the kept requests, then fresh inputs at every bucket."""
        engine = candidate.engine
        assert engine is not None
        for inputs, answer in self._samples:
            self._agree(candidate, inputs, answer, engine.run(inputs), "a served request")
        rng = np.random.default_rng(len(self._tried))
        for size in self.buckets:
            feeds = proof_feeds(self.signature, size, rng)
            try:
                reference = self._current.run_parts([feeds])
            except EngineError as exc:  # inputs the model does not take (a value-dependent graph): no evidence
                if is_gpu_fault(exc.message):
                    raise
                continue
            self._agree(candidate, feeds, reference, engine.run_parts([feeds]), f"fresh inputs at bucket {size}")

    def _agree(self, candidate: _Candidate, inputs: Mapping[str, np.ndarray], reference: dict[str, np.ndarray],
               got: dict[str, np.ndarray], what: str) -> None:
        check = agreement([(reference, got)], PROOF_REL_L2)
        if not check.ok:
            rows = next(iter(inputs.values())).shape[0]
            raise _Refused(_config_for(candidate.record, candidate.engine, rows),
                           f"it answered differently from {self.variant} on {what}: {check.reason}")

    def _switch(self, candidate: _Candidate) -> None:
        engine = candidate.engine
        assert engine is not None
        old, self._current, self._candidate = self._current, engine, None
        self.record = {**candidate.record, "proven": True}
        self.state = f"serving {candidate.config.key}, proven"
        logger.info("engine %s: switched from %s to %s, proven here on %d served request(s) and fresh inputs at "
                    "every bucket", self.label, old.variant, engine.variant, len(self._samples))
        self._samples.clear()
        old.close()
        self._report_proven(self.record)

    def _refuse(self, candidate: _Candidate, refused: _Refused) -> bool:
        """Refuse the failed configuration store-wide, close the candidate, try the next fastest one."""
        logger.warning("engine %s: %s refused: %s; %s serves on", self.label, refused.config.key, refused,
                       self.variant)
        if candidate.engine is not None:
            with contextlib.suppress(Exception):
                candidate.engine.close()
        self._candidate = None
        self._report_refused(refused.config, str(refused), refused.kind)
        self.state = f"{refused.config.key} refused ({first_line(str(refused), limit=120)})"
        following = self._next_record(candidate.record) if len(self._tried) < MAX_ATTEMPTS else None
        if following is None:
            return False
        return self._consider(following)

    def _next_record(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The next fastest timed configuration with CUDA graphs not tried yet, as a record of its own (no split,
        the cheap cuDNN search: both were measured for the winner only)."""
        timings = record.get("timings_ms") or {}
        winner = Config(**record["choice"]).key  # tried already (``_consider``)
        options = [key for key in timings if key not in self._tried and "/no-graph" not in key]
        if not options:
            return None
        key = min(options, key=lambda k: score(timings[k], timings[winner]) if winner in timings else 1.0)
        config = Config.from_key(key)
        return {k: v for k, v in record.items() if k != "split"} | {
            "choice": config.to_dict(), "reason": f"next fastest after {winner} was refused",
            conv_search.FIELD: conv_search.unmeasured(config, "measured for the winner only")}

    # ------------------------------------------------------------------ faults and reports
    def _fault(self, config: Config, error: str) -> None:
        """The CUDA context is lost: remember it, refuse ``config`` store-wide (before anything else can fail)."""
        self._lost = error[:300]
        self.state = f"the GPU faulted ({first_line(error, limit=120)})"
        logger.error("engine %s: the GPU faulted with %s: %s; this process's CUDA context is lost", self.label,
                     config.key, error)
        if self._job is not None:
            self._job.cancel()
        self._report_refused(config, error, FAULT)

    def _report_refused(self, config: Config, error: str, kind: str) -> None:
        if self._reports is None:
            return
        try:
            self._reports.refused([self._identity.entry(config, error, self._candidates, kind=kind)])
        except Exception:  # a cache of what to skip: serving goes on
            logger.exception("engine %s: refusing %s was not recorded", self.label, config.key)

    def _report_proven(self, record: dict[str, Any]) -> None:
        if self._reports is None:
            return
        try:
            self._reports.proven(record)
        except Exception:
            logger.exception("engine %s: its proven record was not stored; a restart tunes again", self.label)

    def _config_serving(self, rows: int) -> Config:
        return _config_for(self.record, self._current, rows)

    # ------------------------------------------------------------------ samples
    def _sampling(self) -> bool:
        return (len(self._samples) < SAMPLES and self._lost is None
                and (self._job is not None or self._candidate is not None))

    def _keep_sample(self, parts: Sequence[Mapping[str, np.ndarray]], outputs: Mapping[str, np.ndarray]) -> None:
        """The call's inputs and answer, copied, when small and on the host (see ``SAMPLE_MAX_ROWS``)."""
        if any(isinstance(value, DeviceRows) for part in parts for value in part.values()):
            return
        if sum(self.signature.rows_of(part) for part in parts) > SAMPLE_MAX_ROWS:
            return
        inputs = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        self._samples.append((inputs, {name: np.array(value, copy=True) for name, value in outputs.items()}))


def proof_feeds(signature: Any, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh inputs for the proof: ``random_feeds``, but an image's pixels (uint8) over their whole range, as
    clients send them (0..3 gives near-black images, whose small logits make relative errors large)."""
    feeds = random_feeds(signature.inputs, rows, rng)
    return {name: rng.integers(0, 256, value.shape, dtype=np.uint8) if value.dtype == np.uint8 else value
            for name, value in feeds.items()}


def _parts(engine: Served, record: Mapping[str, Any]) -> list[tuple[OrtEngine, Config]]:
    """Each engine of ``engine`` with the configuration it runs."""
    primary, large = Config(**record["choice"]), split_config(record)
    if isinstance(engine, SplitEngine) and large is not None:
        return [(engine.primary, primary), (engine.large, large)]
    return [(engine, primary)]


def _config_for(record: Mapping[str, Any], engine: Any, rows: int) -> Config:
    """The configuration that runs a batch of ``rows`` (a split's large engine for its buckets)."""
    large = split_config(record)
    if isinstance(engine, SplitEngine) and large is not None and engine.bucket_for(rows) in engine.large_buckets:
        return large
    return Config(**record["choice"])


def _same_engine(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two records build the same engine: configuration, split buckets and cuDNN search."""

    def key(record: Mapping[str, Any]) -> tuple[Any, ...]:
        large = split_config(record)
        search = (record.get(conv_search.FIELD) or {}).get("choice")
        return (Config(**record["choice"]).key, tuple((record.get("split") or {}).get("buckets") or ()),
                large.key if large else None, search or conv_search.CHEAP)

    return key(a) == key(b)


__all__ = ["MAX_ATTEMPTS", "SAMPLES", "SwitchingEngine", "TuneJob"]
