"""Service configuration: a short list of user settings, a few advanced ones, one definition of each bound.

Environment variables use the prefix ``SERVICE_`` (``SERVICE_PORT``, ``SERVICE_MAX_BATCH_SIZE``, ...). User
settings are what an operator sets; advanced settings (marked ``advanced`` in their schema, listed in
``ADVANCED``) exist for the rare deployment that needs them. What used to be a switch for an experiment is a
constant where it is decided, or a choice the tuner makes. A variable of an earlier release that is
still set stops the server with one line naming it and what replaced it (``check_environment``).

The bounds of the settings that a model's own config may override (batch size, delay, queue, timeout,
precision, buckets) are the ``Annotated`` types below; ``service.model_config`` uses the same types.
No settings object lives at module level: ``create_app(settings)`` keeps it on ``app.state``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

ENV_PREFIX = "SERVICE_"
MAX_BUCKETS = 16
"""Each bucket costs an IO binding and (on CUDA) a captured graph: keep the count bounded."""
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
BUILT_FUSED_OPS = Path(__file__).resolve().parents[1] / "kernels" / "build" / "libonnxcnn_ops.so"
"""Where ``python -m kernels.build`` leaves the fused-op library in this checkout (``fused_ops_library`` auto)."""


def _valid_buckets(value: tuple[int, ...]) -> tuple[int, ...]:
    if not value or len(value) > MAX_BUCKETS:
        raise ValueError(f"give 1 to {MAX_BUCKETS} buckets")
    if any(b < 1 or b > 4096 for b in value):
        raise ValueError("buckets must be between 1 and 4096")
    return tuple(sorted(set(value)))


MaxBatchSize = Annotated[int, Field(ge=1, le=4096)]
MaxDelayMs = Annotated[float, Field(ge=0.0, le=1000.0)]
QueueSize = Annotated[int, Field(ge=1, le=1_000_000)]
TimeoutS = Annotated[float, Field(gt=0.0, le=3600.0)]
Precision = Literal["fp32", "fp16", "bf16", "auto"]
Buckets = Annotated[tuple[int, ...], AfterValidator(_valid_buckets)]


def _advanced(description: str) -> dict[str, Any]:
    return {"description": description, "json_schema_extra": {"advanced": True}}


class ServiceSettings(BaseSettings):
    """Every setting of the service; environment variable ``SERVICE_<FIELD NAME IN CAPITALS>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    # ----------------------------------------------------------------------------- user settings
    host: str = Field("127.0.0.1", description="Bind address: loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: pick a free one).")
    grpc_port: int | None = Field(
        8001, ge=0, le=65535, description="KServe V2 gRPC port on the same host (0: pick a free one; off: no gRPC)."
    )
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain: both listeners speak TLS (HTTPS and gRPC over TLS) when set."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    model_dir: Path = Field(Path("models"), description="The durable model store (a folder).")
    admin_token: SecretStr | None = Field(
        None, description="Bearer token (16+ characters) for uploads and deletes; unset disables them (403)."
    )
    workers: int = Field(
        1, ge=1, le=64, description="HTTP worker processes sharing the port; with more than one, an engine "
        "process per device runs every worker's batches.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    demo_model: bool = Field(True, description="Install the demo model (mobilenet_v3_large) in a fresh store.")
    default_model: str | None = Field(
        "mobilenet_v3_large", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The model a POST /predict that names none goes to, while the server holds it (else: the "
        "only model loaded); empty: always the only model loaded.",
    )
    max_request_mb: int = Field(64, ge=1, le=4096, description="Largest inference request body, in MiB (413).")
    max_upload_mb: int = Field(512, ge=1, le=16384, description="Largest model upload, in MiB (413).")
    shared_memory_mb: int = Field(
        4096, ge=0, le=1 << 20, description="Triton's system and CUDA shared-memory extensions, for clients on this "
        "host: the most MiB of regions registered at once, in all (at most 64 regions); 0 turns them off."
    )
    shutdown_grace_s: float = Field(30.0, ge=0, le=600, description="Time in-flight requests get on SIGTERM.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: the GPU when CUDA is usable, else the CPU; cuda: a model that cannot load "
        "on the GPU fails.",
    )
    devices: str = Field(
        "all", description="The GPUs to serve on: a comma list of CUDA ordinals (0,1) or all (every visible GPU; "
        "the CPU counts as one device). With more than one, each device gets its own engine process, loading "
        "every model, and the workers spread their batches over them.",
    )
    precision: Precision = Field(
        "fp32", description="Default precision of new models: fp32, fp16 (CUDA), bf16 (CPU, OpenVINO EP), or auto "
        "(the tuner measures full and reduced precision; the reduced one only once it passed its check)."
    )
    max_batch_size: MaxBatchSize = Field(
        64, description="Most samples in one engine call (1: no batching); a model's config may lower it."
    )
    max_delay_ms: MaxDelayMs = Field(
        0.0, description="Extra wait for more requests once the engine is free (0: whatever queued while the "
        "engine was busy forms the next batch).",
    )
    queue_size: QueueSize = Field(1024, description="Most samples waiting per model; beyond, 503 + Retry-After.")
    request_timeout_s: TimeoutS = Field(30.0, description="Per-request deadline, queueing and compute (504).")
    cpu_threads: int = Field(0, ge=0, le=256, description="ONNX Runtime threads on the CPU provider (0: all cores).")

    # ----------------------------------------------------------------------------- advanced settings
    buckets: Buckets = Field(
        DEFAULT_BUCKETS, **_advanced("Batch-size buckets: on a GPU one ONNX Runtime session (with its own copy of "
                                     "the weights), IO binding and CUDA graph each; a batch is padded up to the next "
                                     "bucket.")
    )
    cudnn_conv_algo_search: Literal["auto", "EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = Field(
        "auto", **_advanced("cuDNN convolution algorithm search. auto: a version serves at once with HEURISTIC (the "
                            "cheaper search to warm up); once it serves, the tuned configuration is timed with "
                            "EXHAUSTIVE against HEURISTIC at every bucket in a child, and EXHAUSTIVE serves only "
                            "where it was over 3 % faster at a bucket. Any other value is used as set.")
    )
    tune_budget_s: float = Field(
        60.0, ge=0.0, le=3600.0, **_advanced("Time the tuner may spend per model on a GPU timing its candidate "
                                             "configurations, each in a child process, once the model serves on "
                                             "its default configuration (the first always runs; refused ones are "
                                             "skipped). The fastest is switched to only once proven where it "
                                             "serves. 0: the default configuration serves, never tuned.")
    )
    fused_conv: bool = Field(True, **_advanced("Let the optimizer emit com.microsoft.FusedConv (Conv+Relu)."))
    fused_ops_library: str = Field(
        "auto", **_advanced("The ai.onnxcnn fused CUDA kernels (libonnxcnn_ops.so): auto: the library that "
                            "python -m kernels.build made in this checkout, when it did; off: never; or a path. Where "
                            "it loads on a GPU, each model also gets a variant lowered to them (verified like every "
                            "rewrite), which the tuner serves only when it times faster.")
    )
    verify: bool = Field(
        True, **_advanced("Check every optimized model against the original before serving it (off is unsafe).")
    )
    optimizer_timeout_s: float = Field(
        300.0, gt=0, le=3600, **_advanced("Wall-clock limit of optimizing and verifying one model.")
    )
    optimizer_memory_mb: int = Field(
        4096, ge=512, le=1_000_000, **_advanced("Address-space limit of the optimizer's child process.")
    )
    store_sync_s: float = Field(
        2.0, gt=0.0, le=3600.0, **_advanced("How often a server picks up the uploads and deletes of the other "
                                            "workers and replicas sharing the store.")
    )
    model_import_dir: Path | None = Field(
        None, **_advanced("A read-only folder of .onnx files (e.g. KServe's /mnt/models): each file is imported into "
                          "the store at startup as a model named after it, unless that file is already stored.")
    )
    shared_memory_remote: bool = Field(
        False, **_advanced("Take the shared-memory register, unregister and status calls from clients on other "
                           "addresses than loopback too (off: they get 403): for a client that shares /dev/shm but "
                           "connects through a network address, e.g. another container with --ipc=container:NAME. "
                           "Any client that reaches the ports can then list, unregister and register regions.")
    )

    @field_validator("grpc_port", mode="before")
    @classmethod
    def _port_or_off(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("off", "none", "false", ""):
            return None
        return value

    @field_validator("default_model", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("fused_ops_library")
    @classmethod
    def _library_file(cls, value: str) -> str:
        """auto, off, or a file that exists (a typo must stop the server, not silently serve without it)."""
        if value not in ("auto", "off") and not Path(value).is_file():
            raise ValueError("give auto, off, or the path of an existing libonnxcnn_ops.so")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _device_list(cls, value: object) -> object:
        """"all", or the ordinals as a canonical comma list (sorted, no repeats)."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ValueError("give a comma list of CUDA ordinals (e.g. 0,1) or all")
        text = value.strip().lower()
        if text == "all":
            return text
        words = [word.strip() for word in text.split(",")]
        if not words or not all(word.isdigit() and len(word) <= 3 for word in words):
            raise ValueError("give a comma list of CUDA ordinals (e.g. 0,1) or all")
        return ",".join(str(n) for n in sorted({int(word) for word in words}))

    @property
    def fused_ops_library_file(self) -> str | None:
        """The library file ``fused_ops_library`` names: "off" none, "auto" this checkout's build where it
        exists, else the path as given (where it does not load, the engine runs without it)."""
        if self.fused_ops_library == "off":
            return None
        if self.fused_ops_library == "auto":
            return str(BUILT_FUSED_OPS) if BUILT_FUSED_OPS.is_file() else None
        return self.fused_ops_library

    @property
    def device_ordinals(self) -> tuple[int, ...] | None:
        """The CUDA ordinals of ``devices``; None for all."""
        return None if self.devices == "all" else tuple(int(word) for word in self.devices.split(","))

    @model_validator(mode="after")
    def _tls_pair(self) -> ServiceSettings:
        """Both or neither, and a pair that loads: a server must not fail on its certificate after starting."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(f"set both {ENV_PREFIX}TLS_CERT_FILE and {ENV_PREFIX}TLS_KEY_FILE, or neither")
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            _check_tls_pair(self.tls_cert_file, self.tls_key_file)
        return self

    @field_validator("host")
    @classmethod
    def _valid_host(cls, value: str) -> str:
        if value == "localhost":
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError("must be an IP address or 'localhost'") from exc
        return value

    @field_validator("admin_token")
    @classmethod
    def _strong_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        if len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters")
        return value


def _check_tls_pair(cert: Path, key: Path) -> None:
    """ValueError naming both variables when the certificate chain and key do not load (never their paths)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        why = "not a PEM certificate chain and its private key" + (f" ({exc.reason})" if exc.reason else "")
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
    else:
        return
    raise ValueError(f"{ENV_PREFIX}TLS_CERT_FILE, {ENV_PREFIX}TLS_KEY_FILE: cannot load them: {why}")


ADVANCED = tuple(
    name for name, field in ServiceSettings.model_fields.items()
    if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("advanced")
)
USER = tuple(name for name in ServiceSettings.model_fields if name not in ADVANCED)

REMOVED: dict[str, str] = {
    "BATCHING__ENABLED": "SERVICE_MAX_BATCH_SIZE=1 (no batching)",
    "BATCHING__MAX_BATCH_SIZE": "SERVICE_MAX_BATCH_SIZE",
    "BATCHING__MAX_DELAY_MS": "SERVICE_MAX_DELAY_MS",
    "BATCHING__QUEUE_SIZE": "SERVICE_QUEUE_SIZE",
    "BATCHING__TIMEOUT_S": "SERVICE_REQUEST_TIMEOUT_S",
    "BATCHING__INLINE_MAX_MS": "a lone request skips the queue when the engine took under 1 ms",
    "ENGINE__DEVICE": "SERVICE_DEVICE",
    "ENGINE__DEVICE_ID": "SERVICE_DEVICES",
    "DEVICE_ID": "SERVICE_DEVICES (a comma list of CUDA ordinals, or all)",
    "ENGINE__BUCKETS": "SERVICE_BUCKETS",
    "ENGINE__CUDNN_CONV_ALGO_SEARCH": "SERVICE_CUDNN_CONV_ALGO_SEARCH",
    "ENGINE__AUTOTUNE": "SERVICE_TUNE_BUDGET_S (0: no timing)",
    "ENGINE__AUTOTUNE_BUDGET_S": "SERVICE_TUNE_BUDGET_S",
    "ENGINE__INTRA_OP_THREADS": "SERVICE_CPU_THREADS",
    "ENGINE__CUDA_GRAPH": "CUDA graphs are captured wherever the model allows",
    "ENGINE__PREFER_NHWC": "the tuner measures both layouts",
    "ENGINE__FUSE_CONV_BIAS": "the tuner measures it",
    "ENGINE__SPLIT_LARGE_BUCKETS": "the tuner decides",
    "ENGINE__DIRECT_COPY": "rows are copied to the GPU directly wherever the CUDA runtime is loaded",
    "ENGINE__CPU_SPINNING": "ONNX Runtime's default is kept",
    "OPTIMIZER__FUSED_CONV": "SERVICE_FUSED_CONV",
    "OPTIMIZER__VERIFY": "SERVICE_VERIFY",
    "OPTIMIZER__TIMEOUT_S": "SERVICE_OPTIMIZER_TIMEOUT_S",
    "OPTIMIZER__MEMORY_LIMIT_MB": "SERVICE_OPTIMIZER_MEMORY_MB",
    "ENGINE_PROCESS": "with SERVICE_WORKERS > 1 one engine process always owns the device",
    "ENGINE_PROCESS_IN_FLIGHT": "each worker keeps 2 batches in flight",
    "ENGINE_PROCESS_PIPELINE": "it measured no gain (docs/benchmarks.md)",
    "BALANCE_CONNECTIONS": "connections are always balanced over the workers",
    "HTTP_BODY_BUFFER_KB": "uvicorn buffers up to 16 MiB of a body",
    "HTTP_GATHER_WRITES": "each response always leaves in one write",
    "GIL_SWITCH_INTERVAL_MS": "the server sets 0.5 ms",
    "HEAP_KEEP_MB": "the server keeps 256 MiB of freed heap",
    "BUSY_POLL_US": "it measured no gain (docs/benchmarks.md)",
}
"""Variables of earlier releases (without the prefix) and what replaced them: a variable, or why none."""
_OLD_GROUPS = ("BATCHING__", "ENGINE__", "OPTIMIZER__")


class SettingsError(ValueError):
    """A setting that stops the server: the message is one line naming the variable."""


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise SettingsError for a removed variable that is still set (the first one, sorted)."""
    environ = os.environ if environ is None else environ
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX):]
        if rest in REMOVED:
            replacement = REMOVED[rest]
            how = f"use {replacement}" if replacement.startswith(ENV_PREFIX) else replacement
            raise SettingsError(f"{key} was removed: {how}")
        if rest.startswith(_OLD_GROUPS):
            raise SettingsError(f"{key} is not a setting any more (settings have no groups: see docs/configuration.md)")


def load_settings(**overrides: Any) -> ServiceSettings:
    """The settings from the environment (and ``overrides``), or SettingsError with one line per problem."""
    check_environment()
    try:
        return ServiceSettings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc)) from None
    except SourceError as exc:  # a list or other JSON value that is not JSON
        raise SettingsError(describe_source_error(exc)) from None


def describe_source_error(exc: SourceError) -> str:
    """``SERVICE_X: not valid JSON ...`` for a variable pydantic-settings could not parse (without the value)."""
    field = re.search(r'field "(\w+)"', str(exc))
    name = f"{ENV_PREFIX}{field.group(1).upper()}" if field else "a SERVICE_ variable"
    return f"{name}: not valid JSON (a list is written [1, 2, 4])"


def describe_errors(exc: ValidationError) -> str:
    """``SERVICE_X: problem`` for each invalid setting, never echoing a value (the token is one)."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{ENV_PREFIX}{str(error['loc'][0]).upper()}: {message}" if error.get("loc") else message)
    return "; ".join(lines)
