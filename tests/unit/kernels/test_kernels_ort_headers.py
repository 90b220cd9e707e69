"""kernels.ort_headers.fetch: the pinned package is verified before it is read, unpacked in Python, only its
include folder kept, unsafe members refused, mirrors tried in order. A fake downloader serves a small .deb
built here (its hash pinned with monkeypatch): no network."""

from __future__ import annotations

import hashlib
import io
import tarfile
import urllib.error
from pathlib import Path

import pytest

from kernels import ort_headers

PREFIX = "./usr/include/onnxruntime/"
DEBIAN_URL = f"{ort_headers.DEFAULT_MIRROR}/{ort_headers.POOL_PATH}"


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


def _fetch(tmp_path: Path, server: Server, **kwargs) -> Path:
    kwargs.setdefault("texts", [])
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


def test_mirrors_are_tried_in_order_until_one_serves_the_file(tmp_path, monkeypatch):
    deb = _pin(monkeypatch, _deb(_data_tar(_headers(), compression="gz"), data_name="data.tar.gz"))
    env_url, apt_url = "http://copy.example/x.deb", f"http://mirror.example/debian/{ort_headers.POOL_PATH}"
    server = Server({env_url: urllib.error.URLError("Name or service not known"), apt_url: TimeoutError("timed out"),
                     DEBIAN_URL: deb})
    texts = ["deb http://mirror.example/debian/ bookworm main\n"]
    dest = _fetch(tmp_path, server, texts=texts, env={ort_headers.URL_ENV: env_url})
    assert server.calls == [env_url, apt_url, DEBIAN_URL]
    assert ort_headers.is_complete(dest) and DEBIAN_URL in (dest / "SOURCE.txt").read_text()
    # no usable apt mirror (not http, or none): deb.debian.org alone; the same URL is not tried twice
    not_http = "deb mirror+file:///etc/apt/mirrors/debian.list trixie main"
    assert ort_headers.candidate_urls([not_http], {}) == [DEBIAN_URL]
    assert ort_headers.candidate_urls([], {ort_headers.URL_ENV: DEBIAN_URL}) == [DEBIAN_URL]


def test_every_failure_is_named_when_no_url_serves_the_file(tmp_path):
    server = Server({DEBIAN_URL: urllib.error.HTTPError(DEBIAN_URL, 404, "Not Found", None, None)})
    with pytest.raises(ort_headers.HeaderError, match="could not download") as raised:
        _fetch(tmp_path, server, texts=["deb http://mirror.example/debian trixie main\n"])
    assert "mirror.example" in str(raised.value) and "404" in str(raised.value)


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
