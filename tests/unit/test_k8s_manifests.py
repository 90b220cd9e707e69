"""Kubernetes manifests without a cluster: every kustomization under docker/k8s renders with ``kubectl
kustomize``; every built-in object validates against the Kubernetes 1.33 API schemas (strict: no unknown
field); checkov's Kubernetes policies pass on what an operator applies; the CRD-based objects (KServe, KEDA,
Prometheus operator) carry the fields their CRDs require; and the promises the server relies on hold
(health paths, shutdown timing, security context, the token from a Secret, the shared store, GPU or not,
ports)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the manifests")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
SECRET_EXAMPLE = K8S / "examples" / "admin-token-secret.yaml"
KUBERNETES_VERSION = "1.33"

# What an operator applies (checkov runs on these); base is only ever applied through an overlay.
DEPLOYABLE = ("overlays/gpu", "overlays/cpu", "overlays/gpu-autoscaled", "kserve")
SERVER_OVERLAYS = ("overlays/gpu", "overlays/cpu", "overlays/gpu-autoscaled")
GPU_OVERLAYS = ("overlays/gpu", "overlays/gpu-autoscaled")
# checkov checks skipped in the manifests (checkov.io/skip annotations). Adding one is a decision: it
# must carry its reason in the annotation and be listed here.
ALLOWED_CHECKOV_SKIPS = {"CKV_K8S_43"}  # image digest: the image is built by the user

# The environment variables the server reads; a name outside this list is a typo the server would ignore.
SERVER_ENV = {
    "SERVICE_HOST",
    "SERVICE_PORT",
    "SERVICE_GRPC_PORT",
    "SERVICE_MODEL_DIR",
    "SERVICE_ADMIN_TOKEN_FILE",
    "SERVICE_WORKERS",
    "SERVICE_DEVICE",
    "SERVICE_SHUTDOWN_GRACE_S",
    "SERVICE_LOG_LEVEL",
    "SERVICE_DEMO_MODEL",
    "SERVICE_MODEL_IMPORT_DIR",
    "SERVICE_STORE_SYNC_S",
}

# Custom resources kubernetes-validate has no schema for: the fields their CRDs require, plus the spec
# fields these manifests rely on. "a.b[].c": every item of list a.b has c.
CRD_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): (
        "spec.containers[].name",
        "spec.containers[].image",
        "spec.supportedModelFormats[].name",
        "spec.protocolVersions",
        "spec.containers[].ports[].containerPort",
    ),
    ("serving.kserve.io/v1beta1", "InferenceService"): (
        "spec.predictor.model.modelFormat.name",
        "spec.predictor.model.runtime",
        "spec.predictor.model.storageUri",
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): (
        "spec.scaleTargetRef.name",
        "spec.triggers[].type",
        "spec.triggers[].metadata.serverAddress",
        "spec.triggers[].metadata.query",
        "spec.triggers[].metadata.threshold",
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "spec.selector.matchLabels",
        "spec.endpoints[].port",
        "spec.endpoints[].path",
    ),
}


# ----------------------------------------------------------------------------- rendering


def _kustomization_roots() -> list[str]:
    """Every folder under docker/k8s with a kustomization that renders on its own (components do not)."""
    roots = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            roots.append(path.parent.relative_to(K8S).as_posix())
    return roots


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """``kubectl kustomize`` of every kustomization root: {root: [objects]}."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: it renders the kustomizations (install kubectl >= 1.27)")
    out: dict[str, list[dict]] = {}
    for root in _kustomization_roots():
        result = subprocess.run(
            [kubectl, "kustomize", str(K8S / root)], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, f"kubectl kustomize {root} failed: {result.stderr}"
        out[root] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _objects(rendered: dict[str, list[dict]], root: str, kind: str) -> list[dict]:
    return [obj for obj in rendered[root] if obj["kind"] == kind]


def _one(rendered: dict[str, list[dict]], root: str, kind: str) -> dict:
    found = _objects(rendered, root, kind)
    assert len(found) == 1, f"{root}: expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else obj["spec"]


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def _server_containers(rendered: dict[str, list[dict]]) -> Iterator[tuple[str, dict, dict]]:
    """(where, pod spec, server container) of every Deployment and ServingRuntime that runs the server."""
    for root in (*SERVER_OVERLAYS, "kserve"):
        for obj in rendered[root]:
            if obj["kind"] in ("Deployment", "ServingRuntime"):
                spec = _pod_spec(obj)
                yield f"{root}:{obj['kind']}", spec, spec["containers"][0]


def _dockerfile_final_stage() -> list[str]:
    lines = re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines()
    instructions = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    last_from = max(i for i, ln in enumerate(instructions) if ln.upper().startswith("FROM "))
    return instructions[last_from:]


def _fields(obj: Any, path: str) -> list[Any]:
    """Values at a dotted path; ``name[]`` descends into every item of a list. Missing: an empty list."""
    values = [obj]
    for part in path.split("."):
        many = part.endswith("[]")
        key = part.removesuffix("[]")
        nxt = []
        for value in values:
            if not isinstance(value, dict) or key not in value:
                return []
            child = value[key]
            if many:
                if not isinstance(child, list) or not child:
                    return []
                nxt.extend(child)
            else:
                nxt.append(child)
        values = nxt
    return values


def test_every_kustomization_renders(rendered: dict[str, list[dict]]) -> None:
    assert set(DEPLOYABLE) | {"base"} <= set(rendered), f"rendered: {sorted(rendered)}"
    for root, objects in rendered.items():
        assert objects, f"{root} renders nothing"
        for obj in objects:
            assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), (root, obj)


# ----------------------------------------------------------------------------- schemas


def test_builtin_objects_match_the_kubernetes_schemas_strictly(rendered: dict[str, list[dict]]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    custom, invalid = [], []
    for root, objects in rendered.items():
        for obj in objects:
            try:
                kv.validate(obj, KUBERNETES_VERSION, strict=True)
            except kv.SchemaNotFoundError:
                custom.append((obj["apiVersion"], obj["kind"]))
            except kv.ValidationError as exc:
                invalid.append(f"{root}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    assert not invalid, "invalid against the Kubernetes schemas:\n" + "\n".join(invalid)
    unknown = set(custom) - set(CRD_FIELDS)
    assert not unknown, f"no schema and no field checks for {sorted(unknown)}: add them to CRD_FIELDS"
    assert set(custom) == set(CRD_FIELDS), "every custom resource kind checked here is rendered somewhere"


def test_custom_resources_carry_the_fields_their_crds_require(rendered: dict[str, list[dict]]) -> None:
    seen = set()
    for root, objects in rendered.items():
        for obj in objects:
            key = (obj["apiVersion"], obj["kind"])
            if key not in CRD_FIELDS:
                continue
            seen.add(key)
            assert isinstance(obj["spec"], dict), f"{root}: {obj['kind']} has no spec"
            for path in CRD_FIELDS[key]:
                values = _fields(obj, path)
                present = values and all(v not in (None, "", [], {}) for v in values)
                assert present, f"{root}: {obj['kind']} lacks {path}"
    assert seen == set(CRD_FIELDS)


def test_the_schema_check_catches_an_unknown_field(rendered: dict[str, list[dict]]) -> None:
    """The validator is strict: a misspelt probe field is an error, not silently dropped by the API server."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    deployment = json.loads(json.dumps(_one(rendered, "overlays/gpu", "Deployment")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kv.ValidationError, match="livenesProbe"):
        kv.validate(deployment, KUBERNETES_VERSION, strict=True)


# ----------------------------------------------------------------------------- checkov


def _checkov() -> str | None:
    """checkov lives in its own environment (its pins clash with pytest's): .venv/tools/checkov, else PATH."""
    tool = Path(sys.prefix) / "tools" / "checkov" / "bin" / "checkov"
    return str(tool) if tool.exists() else shutil.which("checkov")


@pytest.fixture(scope="module")
def checkov_report(rendered: dict[str, list[dict]], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One checkov run (several seconds) over every deployable rendering and the Secret example."""
    checkov = _checkov()
    if checkov is None:
        pytest.skip("checkov is not installed: scripts/setup.sh test puts it in .venv/tools/checkov")
    folder = tmp_path_factory.mktemp("rendered")
    files = [SECRET_EXAMPLE]
    for root in DEPLOYABLE:
        files.append(folder / (root.replace("/", "-") + ".yaml"))
        files[-1].write_text(yaml.safe_dump_all(rendered[root], sort_keys=False))
    command = [checkov, "--framework", "kubernetes", "--skip-download", "--output", "json", "--compact"]
    for path in files:
        command += ["--file", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(result.stdout)
    return report if isinstance(report, list) else [report]


@pytest.mark.slow  # checkov's run: 6-10 s on a 2-core machine, once per session
def test_checkov_kubernetes_policies_pass(checkov_report: list[dict]) -> None:
    (kubernetes,) = [r for r in checkov_report if r["check_type"] == "kubernetes"]
    summary = kubernetes["summary"]
    failed = [f"{c['check_id']} {c['check_name']} ({c['resource']})" for c in kubernetes["results"]["failed_checks"]]
    assert not failed, "checkov failures:\n" + "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 50, f"checkov ran almost nothing: {summary}"
    skipped = kubernetes["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} <= ALLOWED_CHECKOV_SKIPS, [c["check_id"] for c in skipped]
    assert all(c["check_result"].get("suppress_comment") for c in skipped), "every skip states its reason"


# ----------------------------------------------------------------------------- probes and shutdown


def _start_period_s() -> int:
    health = next(ln for ln in _dockerfile_final_stage() if ln.upper().startswith("HEALTHCHECK"))
    return int(re.search(r"--start-period=(\d+)s", health).group(1))


def _prestop_sleep_s(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"], "the image has /bin/sh; anything else is not there"
    words = shlex.split(command[2])
    assert words[0] == "sleep" and len(words) == 2, command
    return int(words[1])


def test_probes_use_the_v2_health_endpoints(rendered: dict[str, list[dict]]) -> None:
    for where, _spec, container in _server_containers(rendered):
        expected = {
            "livenessProbe": "/v2/health/live",
            "readinessProbe": "/v2/health/ready",
            "startupProbe": "/v2/health/ready",
        }
        for probe, path in expected.items():
            get = container[probe]["httpGet"]
            assert get["path"] == path, f"{where}: {probe} asks {get['path']}"
            assert get["port"] == "http", f"{where}: {probe} must target the REST port"
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        # At least the Dockerfile's start period, and 10 min: optimizing and verifying one model may take
        # 300 s (the optimizer's default timeout), the load-time tuner 60 s, then warm-up of every bucket.
        assert budget >= max(_start_period_s(), 600), f"{where}: startup budget {budget} s is too short"


def test_grace_period_covers_the_drain_and_the_prestop_sleep(rendered: dict[str, list[dict]]) -> None:
    for where, spec, container in _server_containers(rendered):
        if where.endswith("ServingRuntime"):  # KServe takes the grace period from the InferenceService
            isvc = _one(rendered, "kserve", "InferenceService")
            grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
        else:
            grace = spec["terminationGracePeriodSeconds"]
        drain = float(_env(container)["SERVICE_SHUTDOWN_GRACE_S"])
        sleep = _prestop_sleep_s(container)
        assert sleep >= 1, f"{where}: the preStop sleep gives endpoints no time to go"
        assert grace > drain + sleep, f"{where}: grace {grace} s <= drain {drain} s + preStop {sleep} s"


# ----------------------------------------------------------------------------- security


def _dockerfile_user() -> tuple[int, int]:
    user = next(ln.split()[1] for ln in _dockerfile_final_stage() if ln.upper().startswith("USER "))
    uid, gid = user.split(":")
    return int(uid), int(gid)


def test_pods_run_as_the_images_non_root_user_with_nothing_extra(rendered: dict[str, list[dict]]) -> None:
    uid, gid = _dockerfile_user()
    for where, spec, container in _server_containers(rendered):
        pod_ctx = spec.get("securityContext")
        if where.endswith("ServingRuntime"):  # KServe takes the pod's security context from the InferenceService
            pod_ctx = _one(rendered, "kserve", "InferenceService")["spec"]["predictor"]["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == uid and pod_ctx["runAsGroup"] == gid
        assert pod_ctx["fsGroup"] == gid, f"{where}: volumes must be writable by the image's group"
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid
        assert ctx["allowPrivilegeEscalation"] is False and ctx.get("privileged", False) is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}, f"{where}: {ctx['capabilities']}"
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}


def _mounts(spec: dict, container: dict) -> dict[str, dict]:
    """{mountPath: volume} of the container."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def test_writable_paths_are_sized_empty_dirs(rendered: dict[str, list[dict]]) -> None:
    """With a read-only root filesystem, /tmp and /dev/shm (the workers' shared tensor buffers) are volumes."""
    for where, spec, container in _server_containers(rendered):
        mounts = _mounts(spec, container)
        for path in ("/tmp", "/dev/shm"):
            assert "emptyDir" in mounts.get(path, {}), f"{where}: {path} is not an emptyDir"
            assert mounts[path]["emptyDir"].get("sizeLimit"), f"{where}: {path} has no sizeLimit"
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_admin_token_comes_from_a_secret_file(rendered: dict[str, list[dict]]) -> None:
    for root in SERVER_OVERLAYS:
        deployment = _one(rendered, root, "Deployment")
        spec = _pod_spec(deployment)
        container = spec["containers"][0]
        names = {item["name"] for item in container.get("env", [])}
        assert "SERVICE_ADMIN_TOKEN" not in names, f"{root}: the token must not sit in the environment"
        token_file = Path(_env(container)["SERVICE_ADMIN_TOKEN_FILE"])
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
        assert mount.get("readOnly") is True
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        secret = volume["secret"]
        assert {"key": "token", "path": token_file.name} in secret["items"]
        assert secret.get("optional", False) is False, f"{root}: a missing token Secret must stop the pod"
        assert not _objects(rendered, root, "Secret"), f"{root}: no Secret (and no token) is rendered from git"


def test_secret_example_is_a_placeholder_the_server_refuses() -> None:
    from pydantic import ValidationError

    from service.settings import ServiceSettings

    example = yaml.safe_load(SECRET_EXAMPLE.read_text())
    assert example["kind"] == "Secret" and example["metadata"]["name"] == "onnx-cnn-serve-admin-token"
    placeholder = example["stringData"]["token"]
    with pytest.raises(ValidationError, match="at least 16 characters"):
        ServiceSettings(admin_token=placeholder)
    for path in K8S.rglob("kustomization.yaml"):
        assert "admin-token-secret" not in path.read_text(), f"{path} applies the placeholder Secret"


def test_the_deployment_mounts_the_secret_the_example_defines(rendered: dict[str, list[dict]]) -> None:
    example = yaml.safe_load(SECRET_EXAMPLE.read_text())
    volumes = _pod_spec(_one(rendered, "overlays/gpu", "Deployment"))["volumes"]
    secret = next(v["secret"] for v in volumes if "secret" in v)
    assert secret["secretName"] == example["metadata"]["name"]
    assert {item["key"] for item in secret["items"]} == set(example["stringData"])
    assert example["metadata"]["namespace"] == _one(rendered, "overlays/gpu", "Deployment")["metadata"]["namespace"]


# ----------------------------------------------------------------------------- storage, devices, ports


def test_replicas_share_a_read_write_many_model_store(rendered: dict[str, list[dict]]) -> None:
    for root in SERVER_OVERLAYS:
        spec = _pod_spec(_one(rendered, root, "Deployment"))
        container = spec["containers"][0]
        model_dir = _env(container)["SERVICE_MODEL_DIR"]
        assert model_dir == "/models"
        claim = _mounts(spec, container)[model_dir]["persistentVolumeClaim"]["claimName"]
        pvc = next(p for p in _objects(rendered, root, "PersistentVolumeClaim") if p["metadata"]["name"] == claim)
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert float(_env(container)["SERVICE_STORE_SYNC_S"]) > 0


def test_gpu_overlays_request_one_gpu_and_the_cpu_overlay_none(rendered: dict[str, list[dict]]) -> None:
    for root in SERVER_OVERLAYS:
        container = _pod_spec(_one(rendered, root, "Deployment"))["containers"][0]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        device = _env(container)["SERVICE_DEVICE"]
        if root in GPU_OVERLAYS:
            assert device == "cuda"
            assert int(limits["nvidia.com/gpu"]) == 1
        else:
            assert device == "cpu"
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests
        cpu_limit = float(limits["cpu"])
        assert cpu_limit >= int(_env(container)["SERVICE_WORKERS"]), f"{root}: fewer cores than workers"


def test_every_container_has_requests_limits_and_a_pull_policy(rendered: dict[str, list[dict]]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for where, _spec, container in _server_containers(rendered):
        resources = container["resources"]
        if where.startswith("kserve"):  # the InferenceService's model resources win over the runtime's
            model = _one(rendered, "kserve", "InferenceService")["spec"]["predictor"]["model"]
            assert model["resources"]["limits"]["nvidia.com/gpu"] == 1
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[part]), f"{where}: {part} {resources[part]}"
        assert container["imagePullPolicy"] in ("Always", "IfNotPresent")
        assert container["image"] == f"onnx-cnn-serve:{version}", f"{where}: image {container['image']}"


def test_env_names_are_ones_the_server_reads_with_valid_values(
    rendered: dict[str, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import ServiceSettings

    isvc_model = _one(rendered, "kserve", "InferenceService")["spec"]["predictor"]["model"]
    for where, _spec, container in _server_containers(rendered):
        env = _env(container)
        if where.startswith("kserve"):  # KServe merges the InferenceService's model env into the runtime's
            env |= _env(isvc_model)
        unknown = {name for name in env if name.startswith("SERVICE_")} - SERVER_ENV
        assert not unknown, f"{where}: the server reads no {sorted(unknown)}"
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            patch.delenv("SERVICE_ADMIN_TOKEN_FILE", raising=False)  # the entrypoint's, not the server's
            settings = ServiceSettings()
        assert settings.port == int(env["SERVICE_PORT"]) == 8000
        assert str(settings.model_dir) == env["SERVICE_MODEL_DIR"]


def test_rest_and_grpc_ports_are_named_and_numbered(rendered: dict[str, list[dict]]) -> None:
    for where, _spec, container in _server_containers(rendered):
        ports = [(p["name"], p["containerPort"]) for p in container["ports"]]
        assert ports == [("http", 8000), ("grpc", 8001)], f"{where}: {ports}"
        env = _env(container)
        assert (env["SERVICE_PORT"], env["SERVICE_GRPC_PORT"]) == ("8000", "8001")
    for root in SERVER_OVERLAYS:
        service = _one(rendered, root, "Service")
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert (ports["http"]["port"], ports["http"]["targetPort"]) == (8000, "http")
        assert (ports["grpc"]["port"], ports["grpc"]["targetPort"]) == (8001, "grpc")
        assert ports["grpc"]["appProtocol"] == "grpc"


def test_selectors_find_the_server_pods(rendered: dict[str, list[dict]]) -> None:
    for root in SERVER_OVERLAYS:
        deployment = _one(rendered, root, "Deployment")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selectors = {
            "Service": _one(rendered, root, "Service")["spec"]["selector"],
            "PodDisruptionBudget": _one(rendered, root, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
            "NetworkPolicy": _one(rendered, root, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
            "Deployment": deployment["spec"]["selector"]["matchLabels"],
        }
        for kind, selector in selectors.items():
            assert selector and selector.items() <= pod_labels.items(), f"{root}: the {kind} selects no server pod"
        rules = _one(rendered, root, "NetworkPolicy")["spec"]["ingress"]
        allowed = {p["port"] for rule in rules for p in rule["ports"]}
        assert allowed == {"http", "grpc"}


def test_objects_carry_the_recommended_labels_and_the_base_no_namespace(rendered: dict[str, list[dict]]) -> None:
    for root in rendered:
        for obj in rendered[root]:
            if obj["kind"] == "Namespace":
                continue
            labels = obj["metadata"].get("labels", {})
            assert labels.get("app.kubernetes.io/name") == "onnx-cnn-serve", f"{root}: {obj['kind']}"
            assert labels.get("app.kubernetes.io/part-of") == "onnx-cnn-serve", f"{root}: {obj['kind']}"
    assert all("namespace" not in obj["metadata"] for obj in rendered["base"]), "the base is namespace-agnostic"
    for root in SERVER_OVERLAYS:
        namespace = _one(rendered, root, "Namespace")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        names = {obj["metadata"].get("namespace") for obj in rendered[root] if obj["kind"] != "Namespace"}
        assert names == {namespace["metadata"]["name"]}, f"{root}: objects outside its namespace: {names}"


# ----------------------------------------------------------------------------- monitoring and autoscaling


def test_pods_are_annotated_for_prometheus(rendered: dict[str, list[dict]]) -> None:
    for root in ("overlays/gpu", "overlays/cpu"):
        annotations = _one(rendered, root, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("8000", "/metrics")


def test_service_monitor_scrapes_the_services_rest_port(rendered: dict[str, list[dict]]) -> None:
    root = "overlays/gpu-autoscaled"
    monitor, service = _one(rendered, root, "ServiceMonitor"), _one(rendered, root, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    # Scraped by the ServiceMonitor only: pod annotations as well would count every series twice.
    annotations = _one(rendered, root, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "false"


def test_keda_scales_the_deployment_on_its_own_queue_depth(rendered: dict[str, list[dict]]) -> None:
    root = "overlays/gpu-autoscaled"
    scaled, deployment = _one(rendered, root, "ScaledObject"), _one(rendered, root, "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count; apply would reset it"
    assert scaled["spec"]["minReplicaCount"] >= 1, "a cold replica takes minutes: never scale to zero"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
    query = trigger["metadata"]["query"]
    assert re.fullmatch(r"sum\(service_queue_depth\{.*\}\)", query), query
    assert f'namespace="{deployment["metadata"]["namespace"]}"' in query, query
    assert f'pod=~"{deployment["metadata"]["name"]}-.+"' in query, query
    assert float(trigger["metadata"]["threshold"]) > 0


# ----------------------------------------------------------------------------- KServe


def test_serving_runtime_serves_onnx_over_v2_rest_and_grpc(rendered: dict[str, list[dict]]) -> None:
    runtime = _one(rendered, "kserve", "ServingRuntime")
    assert "onnx" in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    container = runtime["spec"]["containers"][0]
    assert container["name"] == "kserve-container"
    env = _env(container)
    assert env["SERVICE_MODEL_IMPORT_DIR"] == "/mnt/models", "KServe's storage initializer writes there"
    assert env["SERVICE_DEMO_MODEL"] == "false"
    store = _mounts(runtime["spec"], container)[env["SERVICE_MODEL_DIR"]]
    assert "emptyDir" in store, "the store is rebuilt from /mnt/models in each pod"
    assert "/mnt/models" not in _mounts(runtime["spec"], container), "KServe mounts /mnt/models itself"
    # KServe's raw mode: the first port is the Service's port 80 (HTTP); a port named *grpc* gets h2c.
    assert container["ports"][0]["name"] == "http" and "grpc" in container["ports"][1]["name"]


def test_inference_service_uses_the_runtime_in_raw_mode(rendered: dict[str, list[dict]]) -> None:
    runtime = _one(rendered, "kserve", "ServingRuntime")
    isvc = _one(rendered, "kserve", "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] == "onnx"
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert re.match(r"^(s3|gs|pvc|https?|hdfs|webhdfs|oci)://", model["storageUri"]), model["storageUri"]
    # Knative (serverless) mode allows one container port; REST and gRPC need the standard (raw) mode.
    mode = isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
    assert mode in ("RawDeployment", "Standard")
