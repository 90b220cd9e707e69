"""kernels.ort_headers.fetch: the pinned package is verified before it is read, unpacked in Python, only its
include folder kept, unsafe members refused, tried where ``$ORT_HEADERS_URL`` and the machine's own apt sources
say, and nowhere else. A fake downloader, a loopback HTTP server or a file:// URL serves a small .deb built
here (its hash pinned with monkeypatch), the apt sources are fake files: no network."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import tarfile
import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels import ort_headers

PREFIX = "./usr/include/onnxruntime/"
MIRROR = "http://127.0.0.1:9/debian"  # only the fake downloader "serves" it
DEBIAN_URL = f"{MIRROR}/{ort_headers.POOL_PATH}"


def _headers() -> dict[str, bytes]:
    files = {PREFIX + name: b"// stand-in\n" for name in ort_headers.REQUIRED}
    files[PREFIX + ort_headers.HEADER] = b"// stand-in\n#define ORT_API_VERSION 21\n"
    files[PREFIX + "core/providers/resource.h"] = b"// nested\n"
    files["./usr/share/doc/libonnxruntime-dev/copyright"] = b"not a header\n"
    return files


def _link(name: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, "/etc/passwd"
    return info


def _directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


def _data_tar(files: dict[str, bytes], extra: tuple[tarfile.TarInfo, ...] = (), compression: str = "xz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}") as tar:
        tar.addfile(_directory(PREFIX))
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        tar.addfile(_link("./usr/lib/x86_64-linux-gnu/libonnxruntime.so"))  # as in the real package: skipped
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size))
    return buffer.getvalue()


def _deb(data: bytes, data_name: str = "data.tar.xz") -> bytes:
    """An ar archive as dpkg-deb writes one (GNU-style "name/" fields; the odd-sized member gets padded)."""
    out = [b"!<arch>\n"]
    for name, body in (("debian-binary", b"2.0\n"), ("control.tar.xz", b"odd"), (data_name, data)):
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode()
        assert len(header) == 60
        out += [header, body, b"\n" * (len(body) % 2)]
    return b"".join(out)


def _pin(monkeypatch, deb: bytes) -> bytes:
    monkeypatch.setattr(ort_headers, "SHA256", hashlib.sha256(deb).hexdigest())
    monkeypatch.setattr(ort_headers, "SIZE", len(deb))
    return deb


class Server:
    """A downloader: each URL serves bytes or raises; anything else is unreachable."""

    def __init__(self, responses: dict[str, bytes | Exception]):
        self.responses, self.calls = responses, []

    def __call__(self, url: str) -> bytes:
        self.calls.append(url)
        response = self.responses.get(url, urllib.error.URLError("unreachable"))
        if isinstance(response, Exception):
            raise response
        return response


def _sources(folder: Path, *lines: str) -> tuple[Path]:
    """A fake ``/etc/apt/sources.list`` holding ``lines`` (outside ``folder``'s headers)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sources.list"
    path.write_text("".join(f"{line}\n" for line in lines))
    return (path,)


def _fetch(tmp_path: Path, server: Server, **kwargs) -> Path:
    kwargs.setdefault("sources", _sources(tmp_path.parent / f"{tmp_path.name}-apt", f"deb {MIRROR} trixie main"))
    kwargs.setdefault("env", {})
    return ort_headers.fetch(tmp_path / "ort-include", download=server, **kwargs)


def test_fetch_verifies_unpacks_the_include_folder_only_and_replaces_the_old_one(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers())))
    dest = tmp_path / "ort-include"
    dest.mkdir()
    (dest / "stale.h").write_text("old\n")
    assert _fetch(tmp_path, Server({DEBIAN_URL: deb})) == dest
    assert ort_headers.is_complete(dest) and ort_headers.api_version(dest) == 21
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert files == {*ort_headers.REQUIRED, "core/providers/resource.h", "SOURCE.txt"}
    source = (dest / "SOURCE.txt").read_text()
    assert all(s in source for s in (ort_headers.PACKAGE, ort_headers.VERSION, DEBIAN_URL, ort_headers.SHA256))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ort-include"]  # no staging or old folder left


def test_wrong_bytes_are_refused_by_hash_before_unpacking(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers())))
    tampered = deb[:-1] + bytes([deb[-1] ^ 1])  # same size, other hash
    (tmp_path / "ort-include").mkdir()
    (tmp_path / "ort-include" / "kept.h").write_text("kept\n")
    server = Server({DEBIAN_URL: tampered})
    with pytest.raises(ort_headers.HeaderError, match=r"sha256") as raised:
        _fetch(tmp_path, server)
    message = str(raised.value)
    assert DEBIAN_URL in message and ort_headers.SHA256 in message and hashlib.sha256(tampered).hexdigest() in message
    assert (tmp_path / "ort-include" / "kept.h").exists()  # untouched
    monkeypatch.undo()  # the real pin: an error page of another size is refused too
    with pytest.raises(ort_headers.HeaderError, match=r"expected sha256 14f7d959.* \(85340 bytes\)"):
        _fetch(tmp_path, Server({DEBIAN_URL: b"<html>404</html>"}))


def _regular(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 3
    return info


@pytest.mark.parametrize("member", [
    _regular(PREFIX + "../../../../escaped.h"),
    _regular("../escaped.h"),
    _regular("/usr/include/onnxruntime/absolute.h"),
    _link(PREFIX + "link.h"),
    _link(PREFIX + "hardlink.h", tarfile.LNKTYPE),
], ids=["dotdot-inside", "dotdot", "absolute", "symlink", "hardlink"])
def test_unsafe_members_are_refused(tmp_path, monkeypatch, member):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers(), extra=(member,))))
    with pytest.raises(ort_headers.HeaderError, match="refusing member"):
        _fetch(tmp_path, Server({DEBIAN_URL: deb}))
    assert list(tmp_path.iterdir()) == []  # nothing written, staging removed
    assert not (tmp_path.parent / "escaped.h").exists()


def test_the_env_url_then_the_apt_mirror_are_tried_and_nothing_else(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers(), compression="gz"), data_name="data.tar.gz"))
    env_url = "http://127.0.0.1:9/copy/x.deb"
    server = Server({env_url: urllib.error.URLError("Connection refused"), DEBIAN_URL: deb})
    dest = _fetch(tmp_path, server, env={ort_headers.URL_ENV: env_url})
    assert server.calls == [env_url, DEBIAN_URL]
    assert ort_headers.is_complete(dest) and DEBIAN_URL in (dest / "SOURCE.txt").read_text()
    assert ort_headers.candidate_urls([], {ort_headers.URL_ENV: env_url}) == [env_url]  # no built-in server after it


@pytest.mark.parametrize("lines", [(), ("deb mirror+file:///etc/apt/mirrors/debian.list trixie main",),
                                   ("deb http://127.0.0.1:9/ubuntu noble main",)],
                         ids=["no sources", "not a URL urllib reads", "no Debian mirror"])
def test_without_the_env_url_or_a_debian_mirror_nothing_is_downloaded(tmp_path, lines):
    server = Server({})
    with pytest.raises(ort_headers.HeaderError, match=r"nowhere to download .*ORT_HEADERS_URL.*--headers DIR"):
        _fetch(tmp_path, server, sources=_sources(tmp_path / "apt", *lines))
    assert server.calls == [] and not (tmp_path / "ort-include").exists()


def test_every_failure_is_named_when_no_url_serves_the_file(tmp_path):
    server = Server({DEBIAN_URL: urllib.error.HTTPError(DEBIAN_URL, 404, "Not Found", None, None)})
    with pytest.raises(ort_headers.HeaderError, match="could not download") as raised:
        _fetch(tmp_path, server, env={ort_headers.URL_ENV: "http://127.0.0.1:9/copy/x.deb"})
    assert "copy/x.deb" in str(raised.value) and "404" in str(raised.value)


@pytest.fixture
def loopback_mirror(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A Debian mirror's folder served over HTTP on a free loopback port: (its root, its URL)."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_the_first_debian_mirror_of_the_apt_sources_is_downloaded_from(tmp_path, monkeypatch, loopback_mirror):
    """The real downloader against a loopback mirror named by a fake deb822 sources file (Ubuntu's stanza first,
    the security archive skipped)."""
    root, url = loopback_mirror
    deb = _pin(monkeypatch, _deb(_data_tar(_headers())))
    (root / "debian" / ort_headers.POOL_PATH).parent.mkdir(parents=True)
    (root / "debian" / ort_headers.POOL_PATH).write_bytes(deb)
    folder = tmp_path / "apt" / "sources.list.d"
    folder.mkdir(parents=True)
    (folder / "a-ubuntu.sources").write_text(f"Types: deb\nURIs: {url}/ubuntu\nSuites: noble\n")
    (folder / "debian.sources").write_text(f"Types: deb\nURIs: {url}/debian-security\nSuites: trixie-security\n\n"
                                           f"Types: deb\nURIs: {url}/debian\nSuites: trixie\n")
    dest = ort_headers.fetch(tmp_path / "ort-include", sources=(tmp_path / "apt" / "sources.list", folder), env={})
    assert ort_headers.api_version(dest) == 21
    assert f"{url}/debian/{ort_headers.POOL_PATH}" in (dest / "SOURCE.txt").read_text()


def test_the_env_url_may_be_a_file_url(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers())))
    copy = tmp_path / "copy.deb"
    copy.write_bytes(deb)
    dest = ort_headers.fetch(tmp_path / "ort-include", sources=(), env={ort_headers.URL_ENV: copy.as_uri()})
    assert ort_headers.is_complete(dest)


def test_the_command_fetches_into_its_folder_and_names_a_failure(tmp_path, monkeypatch, capsys):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers())))
    (tmp_path / "copy.deb").write_bytes(deb)
    monkeypatch.setenv(ort_headers.URL_ENV, (tmp_path / "copy.deb").as_uri())
    assert ort_headers.main([str(tmp_path / "inc")]) == 0 and ort_headers.is_complete(tmp_path / "inc")
    monkeypatch.setattr(ort_headers, "SHA256", "0" * 64)
    assert ort_headers.main([str(tmp_path / "other")]) == 1
    assert capsys.readouterr().err.startswith("error: could not download")


def test_a_zstd_data_member_is_a_clear_error(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(b"(zstd frames)", data_name="data.tar.zst"))
    with pytest.raises(ort_headers.HeaderError, match=r"data\.tar\.zst is compressed in a way Python's tarfile"):
        _fetch(tmp_path, Server({DEBIAN_URL: deb}))


def test_a_package_without_the_headers_is_refused(tmp_path, monkeypatch):
    files = {name: body for name, body in _headers().items() if not name.endswith(ort_headers.REQUIRED[1])}
    deb = _pin(monkeypatch, _deb(_data_tar(files)))
    with pytest.raises(ort_headers.HeaderError, match="no complete ONNX Runtime include folder"):
        _fetch(tmp_path, Server({DEBIAN_URL: deb}))
    with pytest.raises(ort_headers.HeaderError, match="not an ar archive"):
        _fetch(tmp_path, Server({DEBIAN_URL: _pin(monkeypatch, b"PK\x03\x04 a zip")}))
