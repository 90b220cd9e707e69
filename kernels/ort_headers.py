"""ONNX Runtime's C/C++ API headers for building the custom-op library, fetched at build time.

The onnxruntime wheels ship no headers, so they come from Debian's ``libonnxruntime-dev`` package
(pinned below), downloaded with the machine's own apt (``apt-get download``, into a private apt state
under the build folder: nothing is installed) and unpacked with ``dpkg -x``. The mirror is the one the
machine's apt sources already use; only the suite differs. Nothing third-party is committed: the headers
live in ``kernels/build/ort-include`` (ignored by git), and a machine without network (the GPU machine)
gets that folder carried along, or ``--headers DIR`` / ``$ORT_INCLUDE_DIR`` names another copy.

API versions: the headers declare ``ORT_API_VERSION`` (21 for 1.21); the library asks the runtime for
exactly that version, which any onnxruntime >= 1.21 serves (ONNX Runtime's C API is versioned and kept
backward compatible; its API version is its minor version: 1.31 serves 1..31). ``check_api_version``
refuses headers newer than the runtime.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

PACKAGE = "libonnxruntime-dev"
VERSION = "1.21.0+dfsg-1"  # Debian 13 (trixie), a stable release: the version stays in its archive
SUITE = "trixie"
HEADER = "onnxruntime_c_api.h"
REQUIRED = (HEADER, "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h")
SYSTEM_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))

Runner = Callable[..., subprocess.CompletedProcess]


class HeaderError(RuntimeError):
    """The headers could not be found or fetched; the message says what to do instead."""


def api_version(include_dir: Path) -> int:
    """The ``ORT_API_VERSION`` that ``include_dir``'s C API header declares."""
    header = include_dir / HEADER
    try:
        text = header.read_text(errors="replace")
    except OSError as exc:
        raise HeaderError(f"no {HEADER} in {include_dir}") from exc
    found = re.search(r"^#define\s+ORT_API_VERSION\s+(\d+)\s*$", text, re.MULTILINE)
    if found is None:
        raise HeaderError(f"{header} declares no ORT_API_VERSION")
    return int(found.group(1))


def runtime_api_version(version: str) -> int:
    """The newest C API version an onnxruntime release serves: its minor version ("1.31.1" -> 31)."""
    found = re.match(r"^1\.(\d+)", version)
    if found is None:
        raise HeaderError(f"cannot read an ONNX Runtime C API version from onnxruntime {version!r}")
    return int(found.group(1))


def check_api_version(header_api: int, runtime_version: str) -> None:
    """Refuse headers whose API version the runtime does not serve."""
    runtime_api = runtime_api_version(runtime_version)
    if header_api > runtime_api:
        raise HeaderError(
            f"the headers declare ORT_API_VERSION {header_api} but onnxruntime {runtime_version} serves up to "
            f"{runtime_api}: use older headers"
        )


def is_complete(include_dir: Path) -> bool:
    return all((include_dir / name).is_file() for name in REQUIRED)


def debian_source(texts: Sequence[str]) -> tuple[str, str | None] | None:
    """``(mirror URI, Signed-By keyring or None)`` of the first Debian archive in apt source texts.

    Reads both formats: deb822 (``URIs:`` / ``Signed-By:`` stanzas) and one-line ``deb [opts] URI suite``.
    Security and update archives are skipped: they do not carry the release's packages.
    """
    for text in texts:
        for uri, keyring in _deb822_entries(text) + _one_line_entries(text):
            if "security" not in uri and "/debian" in uri:
                return uri.rstrip("/"), keyring
    return None


def _deb822_entries(text: str) -> list[tuple[str, str | None]]:
    entries = []
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*?)\s*$", stanza, re.MULTILINE))
        if "deb" not in fields.get("Types", "").split() or fields.get("Enabled", "yes") == "no":
            continue
        entries += [(uri, fields.get("Signed-By") or None) for uri in fields.get("URIs", "").split()]
    return entries


def _one_line_entries(text: str) -> list[tuple[str, str | None]]:
    entries = []
    for line in text.splitlines():
        found = re.match(r"^\s*deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+\S+", line)
        if found:
            options, uri = found.group(1) or "", found.group(2)
            keyring = re.search(r"signed-by=(\S+)", options)
            entries.append((uri, keyring.group(1) if keyring else None))
    return entries


def system_source_texts(paths: Sequence[Path] = SYSTEM_SOURCES) -> list[str]:
    texts = []
    for path in paths:
        files = sorted(path.glob("*.sources")) + sorted(path.glob("*.list")) if path.is_dir() else [path]
        for file in files:
            try:
                texts.append(file.read_text(errors="replace"))
            except OSError:
                continue
    return texts


def fetch(dest: Path, *, work_dir: Path, run: Runner = subprocess.run, texts: Sequence[str] | None = None) -> Path:
    """Download ``PACKAGE=VERSION`` with apt and unpack its headers into ``dest``; returns ``dest``."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise HeaderError("apt-get/dpkg-deb not found: pass --headers DIR (ONNX Runtime's include folder)")
    source = debian_source(system_source_texts() if texts is None else texts)
    if source is None:
        raise HeaderError("no Debian archive in this machine's apt sources: pass --headers DIR")
    uri, keyring = source
    apt = work_dir / "apt"
    for sub in ("lists/partial", "cache/archives/partial", "debs"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    signed = f" [signed-by={keyring}]" if keyring else ""
    (apt / "sources.list").write_text(f"deb{signed} {uri} {SUITE} main\n")
    options = [
        f"-oDir::Etc::SourceList={apt / 'sources.list'}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt / 'cache'}",
        "-oAPT::Sandbox::User=root",
        "-qq",
    ]
    _run(run, ["apt-get", *options, "update"], "apt-get update")
    download = ["apt-get", *options, "download", f"{PACKAGE}={VERSION}"]
    _run(run, download, f"apt-get download {PACKAGE}", cwd=apt / "debs")
    debs = sorted((apt / "debs").glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise HeaderError(f"apt-get download left no {PACKAGE} package")
    with tempfile.TemporaryDirectory(dir=work_dir) as unpacked:
        _run(run, ["dpkg-deb", "-x", str(debs[-1]), unpacked], "dpkg-deb -x")
        include = Path(unpacked) / "usr" / "include" / "onnxruntime"
        if not is_complete(include):
            raise HeaderError(f"{debs[-1].name} holds no complete ONNX Runtime include folder")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(include, dest)
    (dest / "SOURCE.txt").write_text(f"Debian {SUITE} package {PACKAGE} {VERSION} (usr/include/onnxruntime)\n")
    shutil.rmtree(apt, ignore_errors=True)  # the package lists are tens of MB: keep only the headers
    return dest


def _run(run: Runner, command: list[str], what: str, cwd: Path | None = None) -> None:
    result = run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip().splitlines()[-3:]
        raise HeaderError(f"{what} failed ({result.returncode}): {' / '.join(tail)}")


def resolve(explicit: Path | None, default: Path, *, work_dir: Path, allow_fetch: bool = True) -> Path:
    """The include folder to build with: ``explicit``, else ``default`` when complete, else fetched there."""
    if explicit is not None:
        if not is_complete(explicit):
            raise HeaderError(f"{explicit} is not an ONNX Runtime include folder (needs {', '.join(REQUIRED)})")
        return explicit
    if is_complete(default):
        return default
    if not allow_fetch:
        raise HeaderError(f"no ONNX Runtime headers in {default.name} and fetching is off: run python -m kernels.build "
                          "on a machine with network first and carry kernels/build/ort-include, or pass --headers DIR")
    return fetch(default, work_dir=work_dir)
