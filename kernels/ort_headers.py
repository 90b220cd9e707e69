"""ONNX Runtime's C/C++ API headers for building the custom-op library, fetched at build time.

The onnxruntime wheels ship no headers. They come from one pinned file: Debian's ``libonnxruntime-dev``
1.21.0+dfsg-1 package (``FILENAME``, in Debian 13 "trixie"), downloaded over HTTP with ``urllib`` and
verified by its size and sha256 (``SIZE``, ``SHA256``: the values in trixie's signed package index) before
anything in it is read, then unpacked in Python (``ar`` + ``tarfile``; no apt, no dpkg, so any Linux or
macOS machine can do it). Only the regular files under ``usr/include/onnxruntime`` are written. Nothing is
installed and nothing third-party is committed: the headers live in ``kernels/build/ort-include`` (ignored
by git), and a machine without network (the GPU machine) gets that folder carried along, or
``--headers DIR`` / ``$ORT_INCLUDE_DIR`` names another copy.

Where from, in order, and nowhere else: ``$ORT_HEADERS_URL`` (a URL of the same file: ``http(s)://`` or
``file://``) if set, then the first Debian mirror of this machine's own apt sources (``/etc/apt/sources.list``,
``/etc/apt/sources.list.d/*.list`` and ``*.sources``). No server is built in: a machine whose sources name no
Debian mirror (Ubuntu's, say) sets ``$ORT_HEADERS_URL``, carries the folder or passes ``--headers DIR``; the
Docker image fetches them in a Debian stage, from that image's own sources. Whatever the URL, the hash must
match. ``python -m kernels.ort_headers DEST`` fetches them alone (the Docker image's headers stage).

API versions: the headers declare ``ORT_API_VERSION`` (21 for 1.21); the library asks the runtime for
exactly that version, which any onnxruntime >= 1.21 serves (ONNX Runtime's C API is versioned and kept
backward compatible; its API version is its minor version: 1.31 serves 1..31). ``check_api_version``
refuses headers newer than the runtime.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath

PACKAGE = "libonnxruntime-dev"
VERSION = "1.21.0+dfsg-1"  # Debian 13 (trixie), a stable release: the version stays in its archive
FILENAME = f"{PACKAGE}_{VERSION}_amd64.deb"  # Multi-Arch: same, so its headers match every arch's
POOL_PATH = f"pool/main/o/onnxruntime/{FILENAME}"
SIZE = 85_340
SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
URL_ENV = "ORT_HEADERS_URL"
TIMEOUT_S = 60
INCLUDE = ("usr", "include", "onnxruntime")  # the folder of the package that is kept
HEADER = "onnxruntime_c_api.h"
REQUIRED = (HEADER, "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h")
SYSTEM_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
MIRROR_SCHEMES = ("http://", "https://", "file:")
"""The mirror URIs of apt sources that ``urllib`` reads (not ``mirror+file:``, ``cdrom:`` or ``tor+http:``)."""

Download = Callable[[str], bytes]


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


def debian_mirror(texts: Sequence[str]) -> str | None:
    """The URI of the first Debian archive in apt source texts that ``urllib`` can read, or None.

    Reads both formats: deb822 (``URIs:`` stanzas) and one-line ``deb [opts] URI suite``. Security and update
    archives are skipped: they do not carry the release's packages.
    """
    for text in texts:
        for uri in _deb822_entries(text) + _one_line_entries(text):
            if "security" not in uri and "/debian" in uri and uri.startswith(MIRROR_SCHEMES):
                return uri.rstrip("/")
    return None


def _deb822_entries(text: str) -> list[str]:
    entries = []
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*?)\s*$", stanza, re.MULTILINE))
        if "deb" not in fields.get("Types", "").split() or fields.get("Enabled", "yes") == "no":
            continue
        entries += fields.get("URIs", "").split()
    return entries


def _one_line_entries(text: str) -> list[str]:
    return [found.group(1) for line in text.splitlines()
            if (found := re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", line))]


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


def download_url(url: str) -> bytes:
    """The body at ``url`` (redirects followed), at most one byte more than ``SIZE``."""
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return response.read(SIZE + 1)


def candidate_urls(texts: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Where to look for ``FILENAME``, in order: ``$ORT_HEADERS_URL``, the apt sources' first Debian mirror;
    HeaderError when there is neither (no server is built in)."""
    urls = [env[URL_ENV]] if env.get(URL_ENV) else []
    mirror = debian_mirror(texts)
    urls += [f"{mirror}/{POOL_PATH}"] if mirror else []
    if not urls:
        raise HeaderError(f"nowhere to download {FILENAME} from: this machine's apt sources name no Debian mirror "
                          f"and ${URL_ENV} is not set; set it to a copy of that file (e.g. in a Debian mirror's "
                          f"{POOL_PATH}), or pass --headers DIR")
    return list(dict.fromkeys(urls))


def verify(data: bytes, url: str) -> None:
    """Refuse anything but the pinned file (checked before a byte of it is parsed)."""
    got = hashlib.sha256(data).hexdigest()
    if len(data) != SIZE or got != SHA256:
        raise HeaderError(f"{url}: got sha256 {got} ({len(data)} bytes), expected sha256 {SHA256} ({SIZE} bytes)")


def ar_members(data: bytes) -> dict[str, bytes]:
    """The members of an ``ar`` archive (a .deb): 60-byte headers, bodies padded to even length."""
    if not data.startswith(b"!<arch>\n"):
        raise HeaderError(f"{FILENAME} is not an ar archive")
    members, pos = {}, 8
    while pos < len(data):
        header = data[pos : pos + 60]
        if len(header) < 60 or header[58:60] != b"`\n" or not header[48:58].strip().isdigit():
            raise HeaderError(f"{FILENAME}: bad ar member header at byte {pos}")
        name, size = header[:16].decode("ascii", "replace").strip().rstrip("/"), int(header[48:58])
        start = pos + 60
        if start + size > len(data):
            raise HeaderError(f"{FILENAME}: ar member {name} is truncated")
        members[name] = data[start : start + size]
        pos = start + size + size % 2
    return members


def data_tar(members: Mapping[str, bytes]) -> tarfile.TarFile:
    """The package's ``data.tar.*`` member, opened (xz, gz or uncompressed)."""
    names = [name for name in members if name.startswith("data.tar")]
    if len(names) != 1:
        raise HeaderError(f"{FILENAME} holds {len(names)} data.tar members, not 1")
    name = names[0]
    modes = {"data.tar": "r:", "data.tar.gz": "r:gz", "data.tar.xz": "r:xz"}
    if name not in modes:
        raise HeaderError(f"{FILENAME}: {name} is compressed in a way Python's tarfile cannot read "
                          "(xz or gz expected): pass --headers DIR")
    try:
        return tarfile.open(fileobj=io.BytesIO(members[name]), mode=modes[name])
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise HeaderError(f"{FILENAME}: {name} is unreadable: {exc}") from exc


def extract_headers(tar: tarfile.TarFile, into: Path) -> int:
    """Write the regular files under ``usr/include/onnxruntime`` into ``into``; returns how many.

    Refuses the whole archive for an absolute path or ``..`` anywhere, and for any link or special file
    under the include folder. Nothing else is extracted.
    """
    written = 0
    for member in tar:
        path = PurePosixPath(member.name)
        if path.is_absolute() or ".." in path.parts:
            raise HeaderError(f"{FILENAME}: refusing member {member.name!r} (its path leaves the archive)")
        parts = [part for part in path.parts if part != "."]
        if tuple(parts[: len(INCLUDE)]) != INCLUDE or member.isdir():
            continue
        if not member.isfile():
            raise HeaderError(f"{FILENAME}: refusing member {member.name!r} (a link or special file)")
        target = into.joinpath(*parts[len(INCLUDE) :])
        target.parent.mkdir(parents=True, exist_ok=True)
        source = tar.extractfile(member)
        target.write_bytes(source.read() if source is not None else b"")
        written += 1
    return written


def unpack(data: bytes, dest: Path, url: str) -> Path:
    """Unpack the (verified) package's headers into a fresh folder next to ``dest``, then put it in place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0o700 would become dest's
        with data_tar(ar_members(data)) as tar:
            extract_headers(tar, staging)
        if not is_complete(staging):
            raise HeaderError(f"{FILENAME} holds no complete ONNX Runtime include folder (needs {', '.join(REQUIRED)})")
        (staging / "SOURCE.txt").write_text(
            f"Debian package {PACKAGE} {VERSION}, usr/include/onnxruntime\nurl: {url}\nsha256: {SHA256}\n"
            f"size: {SIZE}\nfetched by kernels/ort_headers.py (not committed)\n")
        old = dest.with_name(f".{dest.name}-old") if dest.exists() else None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            dest.rename(old)
        try:
            staging.rename(dest)
        except OSError:
            if old is not None:
                old.rename(dest)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return dest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(
    dest: Path,
    *,
    download: Download = download_url,
    sources: Sequence[Path] = SYSTEM_SOURCES,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Download the pinned package from the first URL that serves it intact (``candidate_urls`` of the apt
    ``sources`` files and ``env``), unpack its headers into ``dest``.

    The 85 KB file is held in memory and the headers are staged next to ``dest``. Raises HeaderError naming
    every URL tried and why it failed.
    """
    urls = candidate_urls(system_source_texts(sources), os.environ if env is None else env)
    failures = []
    for url in urls:
        try:
            data = download(url)
        except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError, HTTPError, timeouts
            failures.append(f"{url}: {exc}")
            continue
        try:
            verify(data, url)
        except HeaderError as exc:
            failures.append(str(exc))
            continue
        return unpack(data, dest, url)
    raise HeaderError(f"could not download {FILENAME} (pass --headers DIR, or set ${URL_ENV} to another copy): "
                      + "; ".join(failures))


def resolve(explicit: Path | None, default: Path, *, allow_fetch: bool = True) -> Path:
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
    return fetch(default)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kernels.ort_headers DEST``: the headers in DEST (fetched unless complete there already)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m kernels.ort_headers", description=main.__doc__)
    parser.add_argument("dest", type=Path, help="the include folder to fill")
    args = parser.parse_args(argv)
    try:
        print(resolve(None, args.dest))
    except HeaderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
