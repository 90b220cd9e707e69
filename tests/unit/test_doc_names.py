"""What the pages (README.md, docs/*.md, loadtests/README.md, bench/README.md) name exists, so an operator who
copies a name gets what the page says:

- every ``SERVICE_*`` variable is a setting (``service.settings``), one that the deployment files read
  (docker/entrypoint.sh, docker/compose.yaml), or, only in docs/configuration.md's generated table of removed
  settings, a removed one (``settings.REMOVED``, which names its replacement); a removed setting's old dotted
  form (``optimizer.memory_limit_mb``) is not named anywhere;
- every repository path (``service/...``, ``tests/...``, ``bench/...``, ``docker/...``, ``scripts/...``; and
  ``registry/sync``-style paths inside ``service/``) exists, every test named (``file.py::test_name``) is defined
  in its file, and every relative link and its ``#anchor`` lead somewhere;
- every Python name: ``service.x.y`` resolves; ``module.Name``/``module.CONSTANT`` (``server.run.KEEP_ALIVE_S``)
  resolves in the service module of that name; a bare ``CONSTANT_NAME`` or ``ClassName`` occurs in the code
  (service/, loadtests/, bench/, docker/, scripts/, kernels/), or is a name of ONNX (an operator), of the KServe
  V2 gRPC protocol, of Kubernetes or of the OS (the lists below).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from pathlib import Path

import pytest

from service.settings import ENV_PREFIX, REMOVED, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "loadtests/README.md", "bench/README.md",
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
CODE_FOLDERS = ("service", "loadtests", "bench", "docker", "scripts", "kernels")
TICKS = re.compile(r"`([^`\n]+)`")
NOT_OURS = {
    # Kubernetes, KServe, KEDA words; OS and tool names; a mathematical E_b
    "AverageValue", "ContainerCreating", "IfNotPresent", "InferenceService", "RuntimeDefault", "ScaledObject",
    "ServingRuntime", "NaN", "RLIMIT_AS", "O_CREAT", "O_EXCL", "SO_REUSEPORT", "CUDA_VISIBLE_DEVICES", "E_1", "E_2",
}
REMOVED_SECTION = re.compile(r"<!-- generated: removed-settings -->.*?<!-- end: removed-settings -->", re.S)


@functools.cache
def _text(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


@functools.cache
def _code() -> str:
    files = [p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".yml", ".toml", ".json", "")
             and "results" not in p.parts and "__pycache__" not in p.parts]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files) + (ROOT / "Dockerfile").read_text()


def _ticked(page: str) -> list[str]:
    return TICKS.findall(_text(page))


# ------------------------------------------------------------------ SERVICE_* variables
SETTINGS = {ENV_PREFIX + name.upper() for name in ServiceSettings.model_fields}
DEPLOYMENT_FILES = ("docker/entrypoint.sh", "docker/compose.yaml")


def _read_variables() -> set[str]:
    """What the deployment files read, and the testing aids the code reads by name (``"SERVICE_..."``)."""
    named = {name for path in DEPLOYMENT_FILES for name in re.findall(r"\bSERVICE_[A-Z0-9_]+", _text(path))}
    return named | set(re.findall(r"[\"'](SERVICE_[A-Z0-9_]+)[\"']", _code()))


def _current(text: str) -> str:
    """``text`` without what it says is gone: the generated table of removed settings, lines saying "removed"."""
    return "\n".join(line for line in REMOVED_SECTION.sub("", text).splitlines() if "removed" not in line.lower())


@pytest.mark.parametrize("page", PAGES)
def test_every_service_variable_is_a_setting(page: str) -> None:
    text = _text(page)
    known = SETTINGS | _read_variables()
    unknown = sorted(set(re.findall(r"\bSERVICE_[A-Z0-9_]*[A-Z0-9]\b", _current(text))) - known)
    assert not unknown, f"{page} names variables the server does not read: {unknown} " + "".join(
        f"\n  {name}: removed, instead {REMOVED[name.removeprefix(ENV_PREFIX)]}" for name in unknown
        if name.removeprefix(ENV_PREFIX) in REMOVED)
    gone = set(re.findall(r"\bSERVICE_[A-Z0-9_]*[A-Z0-9]\b", text)) - set(re.findall(r"\bSERVICE_\w+", _current(text)))
    listed = re.findall(r"^\| `(SERVICE_\w+)` \|", "".join(REMOVED_SECTION.findall(text)), re.M)
    for name in sorted(gone - SETTINGS - _read_variables()) + listed:
        assert name.removeprefix(ENV_PREFIX) in REMOVED, (
            f"{page}: {name} is said to be removed, but service/settings.py's REMOVED does not list it (with its "
            "replacement): setting it would be ignored without a word")


@pytest.mark.parametrize("page", PAGES)
def test_no_old_dotted_setting_is_named(page: str) -> None:
    old = {key.lower().replace("__", ".") for key in REMOVED if "__" in key}
    named = sorted(old & set(_ticked(page)))
    assert not named, f"{page} names settings of an earlier release: {named} (docs/configuration.md lists them)"


# ------------------------------------------------------------------ paths, tests, links
PATH = re.compile(r"(?<![\w/.-])((?:service|tests|bench|docker|scripts|loadtests|kernels|docs)/[\w./<>*{}-]*[\w/>*}])")
SERVICE_PACKAGES = sorted(p.name for p in (ROOT / "service").iterdir() if p.is_dir() and not p.name.startswith("_"))
INNER = re.compile(rf"^(?:{'|'.join(SERVICE_PACKAGES)})/[\w/]+(?:\.py)?/?$")


def _exists(relative: str) -> bool:
    path = ROOT / relative.rstrip("/")
    return path.exists() or path.with_suffix(".py").exists()


@pytest.mark.parametrize("page", PAGES)
def test_every_repository_path_exists(page: str) -> None:
    text = _text(page)
    missing = [path for path in PATH.findall(_current(text)) if not set("<*{") & set(path) and not _exists(path)]
    inner = [tok for tok in _ticked(page) if INNER.match(tok) and not _exists(f"service/{tok}")]
    assert not missing + inner, f"{page} names paths that do not exist: {missing + inner}"


NODE = re.compile(r"(?:(?P<file>[\w/]*test_\w+\.py))?::(?P<test>test_\w+\*?)")


def _test_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        found.setdefault(path.name, []).append(path)
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_named_test_exists(page: str) -> None:
    files, last, missing = _test_files(), None, []
    text = _text(page)
    for name in re.findall(r"(?<![\w/])((?:tests/[\w/]+/)?test_\w+\.py)", text):
        if not (ROOT / name).is_file() and Path(name).name not in files:
            missing.append(name)
    for match in NODE.finditer(text):
        last = match["file"] or last
        candidates = [ROOT / last] if last and "/" in last else files.get(Path(last or "").name, [])
        wanted = match["test"].rstrip("*")
        pattern = rf"^(?:async )?def {wanted}" + ("" if match["test"].endswith("*") else r"\(")
        if not any(path.is_file() and re.search(pattern, path.read_text(), re.M) for path in candidates):
            missing.append(f"{last}::{match['test']}")
    assert not missing, f"{page} names tests that do not exist: {missing}"


LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", page.read_text(encoding="utf-8"), re.M):
        text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES)
def test_every_link_leads_somewhere(page: str) -> None:
    broken = []
    for target in LINK.findall(_text(page)):
        file, _, anchor = target.partition("#")
        path = (ROOT / page).parent / file if file else ROOT / page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{page} links nowhere: {broken}"


# ------------------------------------------------------------------ Python names
@functools.cache
def _modules() -> dict[str, list[str]]:
    """Last component of each service module -> the modules' full names (``run`` -> ``service.server.run``)."""
    found: dict[str, list[str]] = {}
    for path in (ROOT / "service").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found.setdefault(parts[-1], []).append(".".join(parts))
    return found


def _resolves(module: str, attributes: list[str]) -> bool:
    try:
        value: object = importlib.import_module(module)
    except ImportError:
        return False
    for attribute in attributes:
        if hasattr(value, attribute):
            value = getattr(value, attribute)
        elif inspect.ismodule(value) and any(hasattr(cls, attribute) and cls.__module__ == value.__name__
                                             for _, cls in inspect.getmembers(value, inspect.isclass)):
            return True  # a method or field of a class of the module (``dataplane.infer``)
        else:
            try:
                value = importlib.import_module(f"{getattr(value, '__name__', '')}.{attribute}")
            except ImportError:
                return False
    return True


def _dotted_problem(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "service":
        for cut in range(len(parts), 0, -1):
            if _resolves(".".join(parts[:cut]), parts[cut:]):
                return None
        return "does not resolve"
    last = parts[-1]
    if last in _protocol_names():
        return None  # inference.GRPCInferenceService: the KServe protocol's own package
    named_thing = last[:1].isupper()  # a class or a constant
    if not named_thing or not re.fullmatch(r"[a-z_]+(\.[A-Za-z_]\w*)+", name):
        return None
    candidates = _modules().get(parts[0], [])
    if not candidates:
        return f"{parts[0]!r} is no module of service" if re.fullmatch(r"[A-Z][A-Z0-9_]+", last) else None
    if any(_resolves(".".join([module, *parts[1:cut]]), parts[cut:]) for module in candidates
           for cut in range(len(parts), 0, -1)):
        return None
    return f"not in {', '.join(candidates)}"


@pytest.mark.parametrize("page", PAGES)
def test_every_python_name_resolves(page: str) -> None:
    problems = [f"{tok}: {why}" for tok in _ticked(page)
                if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", tok) and not tok.endswith((".py", ".md", ".json"))
                for why in [_dotted_problem(tok)] if why]
    assert not problems, f"{page}: " + "; ".join(problems)


@functools.cache
def _protocol_names() -> set[str]:
    """ONNX operators and the KServe V2 gRPC service's RPCs and messages: names that are not ours."""
    import onnx
    from tritonclient.grpc import service_pb2

    names = {schema.name for schema in onnx.defs.get_all_schemas_with_history()}
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return (names | {method.name for method in service.methods} | set(service_pb2.DESCRIPTOR.message_types_by_name)
            | set(service_pb2.DESCRIPTOR.services_by_name))


@pytest.mark.parametrize("page", PAGES)
def test_every_named_constant_and_class_exists(page: str) -> None:
    words = {word for tok in _ticked(page) for word in re.findall(r"\b(?:[A-Z][A-Z0-9]*_[A-Z0-9_]+|"
                                                                   r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)\b", tok)}
    words = {w for w in words if not w.startswith(("SERVICE_", "LOADTEST_", "TYPE_", "CKV_"))}
    code = _code()
    unknown = sorted(w for w in words - NOT_OURS - _protocol_names() if not re.search(rf"\b{w}\b", code))
    assert not unknown, f"{page} names what the code does not have: {unknown}"
