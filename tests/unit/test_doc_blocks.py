"""The pages' fenced blocks without a server (tests/helpers/doc_blocks.py says how blocks are read): every
example is run by tests/e2e/test_doc_examples.py or marked with why not; what a ``needs: kubernetes`` or
``needs: docker`` example applies exists and renders (``kubectl kustomize``, the compose file, the build
context); every YAML block parses, and a kustomization shown as an overlay of one's own renders over the
shipped manifests."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from doc_blocks import NEEDS, ROOT, STARTS, Block, blocks, commands, pages

yaml = pytest.importorskip("yaml", reason="pyyaml reads the YAML blocks and the compose file")

ALL = [block for page in pages() for block in blocks(page)]
COMMAND_WORDS = {"curl", "kubectl", "docker", "python", "python3", "pip", "export", "openssl", "locust", "cd", "sudo",
                 "helm", "kustomize"}
COMMAND_PREFIXES = ("scripts/", ".venv/", "SERVICE_")
KUBECTL = shutil.which("kubectl")


def _ids(found: list[Block]) -> list[str]:
    return [block.where() for block in found]


def test_every_page_with_examples_is_read() -> None:
    assert {"README.md", "docs/grpc.md", "docs/images.md", "docs/kubernetes.md"} <= set(pages())
    assert set(pages()) >= {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert sum(block.runs for block in ALL) >= 12, "the examples are found (a broken fence pattern finds none)"


@pytest.mark.parametrize("block", [b for b in ALL if b.marker], ids=_ids([b for b in ALL if b.marker]))
def test_a_block_that_is_not_run_says_why(block: Block) -> None:
    assert block.example, f"{block.where()}: a marker on a {block.lang or 'text'} block, which is never run"
    if block.marker == "not run":
        assert any(start in block.body for start in STARTS), f"{block.where()} is marked not run but starts nothing"
    else:
        assert block.why in NEEDS, f"{block.where()}: needs {block.why!r}; say one of {NEEDS}"


@pytest.mark.parametrize("block", [b for b in ALL if not b.lang], ids=_ids([b for b in ALL if not b.lang]))
def test_a_block_without_a_language_is_no_command(block: Block) -> None:
    """A command in a block without a language would escape the examples' test: label it bash or python."""
    first = next((line.split()[0] for line in block.body.splitlines() if line.strip()), "")
    assert first not in COMMAND_WORDS and not first.startswith(COMMAND_PREFIXES), f"{block.where()}: {first} ..."


def _cluster_or_docker(block: Block) -> bool:
    return any(re.match(r"(kubectl|docker)\b", line) for line in commands(block.body))


@pytest.mark.parametrize("block", [b for b in ALL if b.runs], ids=_ids([b for b in ALL if b.runs]))
def test_an_example_that_needs_a_cluster_or_docker_is_marked(block: Block) -> None:
    assert not (block.shell and _cluster_or_docker(block)), f"{block.where()}: mark it <!-- needs: ... -->"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("yaml", "yml")],
                         ids=_ids([b for b in ALL if b.lang in ("yaml", "yml")]))
def test_yaml_blocks_parse(block: Block) -> None:
    documents = [doc for doc in yaml.safe_load_all(block.body) if doc is not None]
    assert documents and all(isinstance(doc, dict) for doc in documents), block.where()


# ------------------------------------------------------------------ needs: kubernetes
def _kustomize_targets(block: Block) -> list[str]:
    """The folders a block's kubectl commands apply (``-k DIR``) or render (``kubectl kustomize DIR``)."""
    targets = []
    for line in commands(block.body):
        words = shlex.split(line)
        if words[:1] != ["kubectl"]:
            continue
        if "-k" in words:
            targets.append(words[words.index("-k") + 1])
        elif words[1:2] == ["kustomize"]:
            targets.append(words[2])
    return targets


KUBE = [b for b in ALL if b.needs == "kubernetes"]


def _render(folder: Path) -> str:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return done.stdout


def test_kubernetes_examples_apply_kustomizations() -> None:
    assert KUBE, "docs/kubernetes.md's examples are marked <!-- needs: kubernetes -->"
    targets = [target for block in KUBE for target in _kustomize_targets(block)]
    assert "docker/k8s/overlays/gpu" in targets and "docker/k8s/kserve" in targets, targets


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the kustomizations cannot be rendered")
@pytest.mark.parametrize("block", KUBE, ids=_ids(KUBE))
def test_what_a_kubernetes_example_applies_renders(block: Block) -> None:
    for target in _kustomize_targets(block):
        assert (ROOT / target / "kustomization.yaml").is_file(), f"{block.where()}: no kustomization in {target}"
        rendered = list(yaml.safe_load_all(_render(ROOT / target)))
        assert any(doc and doc.get("kind") for doc in rendered), f"{block.where()}: {target} renders nothing"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the kustomizations cannot be rendered")
def test_an_overlay_of_ones_own_renders_over_the_shipped_manifests(tmp_path: Path) -> None:
    """A YAML block headed ``# DIR/kustomization.yaml`` is a kustomization next to the repository's
    ``docker/`` (as docs/kubernetes.md's "Changing it" shows): it renders, and its changes show."""
    examples = [b for b in ALL if b.lang == "yaml" and re.match(r"# [\w.-]+/kustomization\.yaml", b.body)]
    assert examples, "docs/kubernetes.md shows an overlay of one's own"
    shutil.copytree(ROOT / "docker", tmp_path / "docker")
    for block in examples:
        folder = tmp_path / block.body.split()[1].split("/")[0]
        folder.mkdir()
        (folder / "kustomization.yaml").write_text(block.body)
        wanted = yaml.safe_load(block.body)
        rendered = [doc for doc in yaml.safe_load_all(_render(folder)) if doc]
        assert {doc["metadata"].get("namespace") for doc in rendered if doc["kind"] != "Namespace"} == {
            wanted["namespace"]}, block.where()
        deployment = next(doc for doc in rendered if doc["kind"] == "Deployment")
        assert deployment["spec"]["replicas"] == wanted["replicas"][0]["count"], block.where()


# ------------------------------------------------------------------ needs: docker
DOCKER = [b for b in ALL if b.needs == "docker"]


def test_docker_examples_are_marked() -> None:
    assert any("docker compose" in b.body for b in DOCKER), "docs/monitoring.md's compose example is marked"


@pytest.mark.parametrize("block", DOCKER, ids=_ids(DOCKER))
def test_what_a_docker_example_names_exists(block: Block) -> None:
    """``docker compose -f FILE [--profile P]... up [SERVICE]...``: the file parses, each profile is some
    service's, each service is in the file and started by the profiles given; ``docker build ... DIR``: DIR
    holds the Dockerfile."""
    for line in commands(block.body):
        words = shlex.split(line)
        if words[:2] == ["docker", "compose"]:
            _check_compose(block, words)
        elif words[:2] == ["docker", "build"]:
            assert (ROOT / words[-1] / "Dockerfile").is_file(), f"{block.where()}: {line}"


def _check_compose(block: Block, words: list[str]) -> None:
    compose = yaml.safe_load((ROOT / words[words.index("-f") + 1]).read_text())
    services = compose["services"]
    given = {words[i + 1] for i, word in enumerate(words) if word == "--profile"}
    known = {profile for service in services.values() for profile in service.get("profiles", [])}
    assert given <= known, f"{block.where()}: profiles {sorted(given - known)} are no service's"
    named = words[words.index("up") + 1:] if "up" in words else []
    for service in (word for word in named if not word.startswith("-")):
        assert service in services, f"{block.where()}: no service {service!r}"
        assert set(services[service].get("profiles", [])) <= given or not services[service].get("profiles"), (
            f"{block.where()}: {service} needs --profile {services[service]['profiles']}")
    started = [name for name, svc in services.items() if not svc.get("profiles") or set(svc["profiles"]) & given]
    assert started, f"{block.where()}: the command starts no service"
