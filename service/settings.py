"""Service configuration (pydantic-settings).

Every field is documented; environment variables use the prefix ``SERVICE_`` and ``__`` for nested
groups, e.g. ``SERVICE_ADMIN_TOKEN``, ``SERVICE_BATCHING__MAX_BATCH_SIZE``, ``SERVICE_ENGINE__DEVICE``.
No settings object lives at module level: ``create_app(settings)`` keeps it on ``app.state``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class BatchingSettings(BaseModel):
    """Dynamic batching defaults; a model's stored config may override them."""

    enabled: bool = Field(True, description="Group concurrent requests into one engine call.")
    max_batch_size: int = Field(
        64, ge=1, le=4096, description="Most samples in one engine call (a request's own batch counts N)."
    )
    max_delay_ms: float = Field(
        0.0,
        ge=0.0,
        le=1000.0,
        description="Extra wait for more requests once the engine is free (0: run at once; whatever queued "
        "while the engine was busy forms the next batch).",
    )
    queue_size: int = Field(
        1024, ge=1, le=1_000_000, description="Most samples waiting per model; beyond it requests get 503."
    )
    timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="Per-request deadline, queueing and compute together (504)."
    )
    inline_max_ms: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="A request the server handles alone runs on the event loop itself, skipping the hand-over "
        "to the engine thread, when the engine last served that many samples within this time (0: never; "
        "only for models without a batching delay).",
    )


class EngineSettings(BaseModel):
    """ONNX Runtime engine settings."""

    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: CUDA when usable, else CPU. cuda: fail the model load if CUDA is not usable."
    )
    device_id: int = Field(0, ge=0, description="CUDA device ordinal.")
    buckets: tuple[int, ...] = Field(
        DEFAULT_BUCKETS,
        description="Batch-size buckets: one IO binding (and CUDA graph) each; inputs are padded up to a bucket.",
    )
    cuda_graph: bool = Field(True, description="Capture one CUDA graph per bucket (CUDA only).")
    prefer_nhwc: Literal["auto", "on", "off"] = Field(
        "auto", description="CUDA EP prefer_nhwc; auto lets the load-time tuner measure both."
    )
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = Field(
        "EXHAUSTIVE", description="cuDNN convolution algorithm search (EXHAUSTIVE costs time at warm-up only)."
    )
    fuse_conv_bias: Literal["auto", "on", "off"] = Field(
        "auto",
        description="CUDA EP fuse_conv_bias: fold each convolution's bias add into the convolution (cuDNN "
        "frontend) instead of a separate bias-add kernel per Conv; auto lets the load-time tuner measure both "
        "(a model loaded without the tuner gets off).",
    )
    direct_copy: bool = Field(
        True,
        description="CUDA: copy each request's rows straight to the device with the CUDA runtime, and "
        "page-lock the engine process's shared buffers, instead of staging the whole padded bucket on the "
        "host (ORT's update_inplace).",
    )
    autotune: bool = Field(True, description="Time candidate variants at load and serve the fastest (CUDA only).")
    split_large_buckets: bool = Field(
        True,
        description="CUDA with graphs: the tuner also times configurations without CUDA graphs and serves the "
        "buckets of 8 and up from one of them where it is at least 5% faster (e.g. fp16 at large batches while "
        "small ones replay an fp32 graph).",
    )
    autotune_budget_s: float = Field(60.0, ge=0.0, le=3600.0, description="Time budget of the load-time tuner.")
    intra_op_threads: int = Field(0, ge=0, le=256, description="ORT intra-op threads on CPU (0: ORT default).")
    cpu_spinning: bool = Field(
        True,
        description="CPU provider: let ORT's intra-op threads spin between runs (ORT's default; lower latency, "
        "but the spinning threads take cores from the event loop).",
    )

    @field_validator("fuse_conv_bias", mode="before")
    @classmethod
    def _bool_means_on_or_off(cls, value: object) -> object:
        """true/false (the setting was a boolean before the tuner measured it) mean on/off."""
        text = str(value).strip().lower()
        return {"true": "on", "1": "on", "false": "off", "0": "off"}.get(text, value)

    @field_validator("buckets")
    @classmethod
    def _sorted_unique_positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value:
            raise ValueError("at least one bucket is required")
        if any(b < 1 or b > 4096 for b in value):
            raise ValueError("buckets must be between 1 and 4096")
        return tuple(sorted(set(value)))


class OptimizerSettings(BaseModel):
    """Graph optimizer settings applied to uploads (a model's stored config may override them)."""

    fused_conv: bool = Field(True, description="Allow com.microsoft.FusedConv (Conv+Relu, Conv+Add+Relu).")
    verify: bool = Field(True, description="Check the optimized model against the original before serving.")
    timeout_s: float = Field(300.0, gt=0, le=3600, description="Wall-clock limit of optimize+verify per model.")
    memory_limit_mb: int = Field(
        4096, ge=512, le=1_000_000, description="Address-space limit of the optimizer child process."
    )


class ServiceSettings(BaseSettings):
    """All service settings. Env prefix ``SERVICE_``; nested groups with ``__``."""

    model_config = SettingsConfigDict(env_prefix="SERVICE_", env_nested_delimiter="__", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address. Loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535, description="Bind port (0: pick a free one).")
    model_dir: Path = Field(Path("models"), description="Durable model repository.")
    admin_token: SecretStr | None = Field(
        None, description="Bearer token for management endpoints; unset disables them (403)."
    )
    max_upload_mb: int = Field(512, ge=1, le=16384, description="Largest accepted model upload, in MiB.")
    max_request_mb: int = Field(64, ge=1, le=4096, description="Largest accepted inference request body, in MiB.")
    demo_model: bool = Field(True, description="Install the zoo's mobilenet_v3_large in a fresh store.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    shutdown_grace_s: float = Field(30.0, ge=0, le=600, description="Time in-flight requests get on SIGTERM.")
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Server processes sharing the port, each with its own engines (one event loop caps HTTP "
        "throughput; on a GPU they share the device).",
    )
    engine_process: bool = Field(
        True,
        description="With workers > 1: one engine process owns the device and runs every worker's batches "
        "(one CUDA context; one engine per model version; batches of several workers merged). Off: each "
        "worker loads its own engines (separate CUDA contexts take turns on the GPU).",
    )
    engine_process_in_flight: int = Field(
        2,
        ge=1,
        le=16,
        description="With the engine process: batches each worker keeps in flight per model (one connection "
        "each), so the next batch forms and travels while one runs.",
    )
    balance_connections: bool = Field(
        True,
        description="With workers > 1: a worker holding more than its share of kept-alive connections closes "
        "one after its response, so that the client reconnects and the kernel places it afresh (it hashes each "
        "connection to a worker at random).",
    )
    engine_process_pipeline: bool = Field(
        False,
        description="With the engine process: a second thread per engine runs it, so that reading the next "
        "batches and answering the last ones overlap the device's work (on the H200 host: no more "
        "throughput, a lone request 0.5 ms slower; it helps where the engine process itself is the limit). "
        "Off: one thread reads, runs and answers in turn.",
    )
    store_sync_s: float = Field(
        2.0, gt=0.0, le=3600.0, description="With workers > 1: how often a worker picks up other workers' "
        "uploads and deletes.",
    )
    http_body_buffer_kb: int = Field(
        16384,
        ge=64,
        le=1_048_576,
        description="Request body uvicorn buffers before pausing the socket (its own default, 64 KiB, costs "
        "event-loop round trips per image tensor: half the HTTP layer's CPU under concurrent load).",
    )
    http_gather_writes: bool = Field(
        True,
        description="Send each response's head and body with one socket write (the writes of one event-loop "
        "step are gathered; uvicorn itself writes them separately, which wakes a waiting client twice).",
    )
    gil_switch_interval_ms: float = Field(
        0.5,
        gt=0.0,
        le=100.0,
        description="Python's thread switch interval in the server (sys.setswitchinterval). Engine threads "
        "wait up to this long for the GIL while the event loop is busy; Python's default is 5 ms.",
    )
    heap_keep_mb: int = Field(
        256,
        ge=0,
        le=65536,
        description="glibc only: freed memory (MiB) the server keeps for reuse, and blocks up to 32 MiB "
        "taken from the heap, so a request's large buffers are not faulted in afresh each time "
        "(0: glibc's defaults).",
    )
    precision: Literal["fp32", "fp16", "auto"] = Field(
        "fp32", description="Default precision for new models (auto: the CUDA tuner may pick fp16)."
    )

    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)

    @field_validator("host")
    @classmethod
    def _valid_host(cls, value: str) -> str:
        if value == "localhost":
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError(f"host must be an IP address or 'localhost', got {value!r}") from exc
        return value

    @field_validator("admin_token")
    @classmethod
    def _strong_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value() and len(value.get_secret_value()) < 16:
            raise ValueError("admin_token must be at least 16 characters")
        if value is not None and not value.get_secret_value():
            return None
        return value
