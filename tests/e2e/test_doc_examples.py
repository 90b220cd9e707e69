"""Every shell and Python example of README.md, docs/*.md and loadtests/README.md runs as written against a
live server, in the order a new user meets them: README.md, then docs/images.md and docs/grpc.md, then the
other pages (tests/helpers/doc_blocks.py reads the blocks; tests/unit/test_doc_blocks.py checks the ones
marked as needing a cluster or Docker, and that the others are marked only when they start the server).

The server is the real ``python -m service serve`` with the demo model, started with the admin token the README
tells the reader to start it with, and one server serves every page, as the reader's would. Each example runs in
one scratch folder (``.venv`` and ``loadtests`` linked into it, ``cat.jpg`` and ``dog.png`` made there: the
README's "photos of yours"), with the pages' ports (8000, 8001) replaced by the live server's: the only change
made to the text. A block fails on a non-zero exit (bash runs with ``-e -o pipefail``, and curl reads a
``.curlrc`` with ``--fail-with-body``, so an HTTP error fails it too), and on output that contradicts what the
block's comments promise: ``# 201`` after a ``%{http_code}`` line, ``# (4, 1000)`` or ``# True`` after a
``print``. Each Python example runs alone, in a fresh interpreter, as a reader pasting it would run it. The
server times no engine variants (``SERVICE_TUNE_BUDGET_S=0``), which changes no answer the pages show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import images
import pytest
from doc_blocks import ROOT, Block, blocks, pages
from live_server import running

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HTTP_CODE = re.compile(r"%\{http_code\}.*#\s*(\d{3})\b")
PRINTED = re.compile(r"print\(.*#\s*(\(.*?\)|True\b|False\b)")


def expected_output(body: str) -> list[str]:
    """What the block's comments promise to print: HTTP status codes, printed tuples and booleans."""
    found = []
    for line in body.splitlines():
        for pattern in (HTTP_CODE, PRINTED):
            match = pattern.search(line)
            if match:
                found.append(match.group(1))
    return found


def server_token() -> str:
    """The token README.md starts the server with (``SERVICE_ADMIN_TOKEN=... scripts/serve.sh``)."""
    for block in blocks("README.md"):
        match = re.search(r"SERVICE_ADMIN_TOKEN=(\S+) scripts/serve\.sh", block.body)
        if match and block.marker == "not run":
            return match.group(1)
    raise AssertionError("README.md no longer says how to start the server with the admin token")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reader's folder: the repository's venv and load tests, two photos, a .curlrc that fails on HTTP errors."""
    folder = tmp_path_factory.mktemp("reader")
    (folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (folder / "loadtests").symlink_to(ROOT / "loadtests", target_is_directory=True)
    (folder / "cat.jpg").write_bytes(images.jpeg(640, 480, seed=1))
    (folder / "dog.png").write_bytes(images.png(320, 240, seed=2))
    (folder / ".curlrc").write_text("--fail-with-body\n--max-time 120\n")
    return folder


def _venv_ok() -> bool:
    return sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "pip").exists()


@pytest.mark.skipif(subprocess.run(["which", "curl"], capture_output=True, check=False).returncode != 0,
                    reason="the examples need curl")
@pytest.mark.skipif(not _venv_ok(), reason="the examples call .venv/bin/pip: run the tests from a virtualenv")
def test_the_examples_run_as_written(tmp_path: Path, workdir: Path) -> None:
    token = server_token()
    # no tuner timing (it chooses among equally correct engines, and took half of this test's time): the
    # pages' five uploads of resnet18 stay within the suite's budget
    env = {"SERVICE_ADMIN_TOKEN": token, "SERVICE_GRPC_PORT": "0", "SERVICE_TUNE_BUDGET_S": "0"}
    examples = [block for page in pages() for block in blocks(page) if block.runs]
    assert {block.page for block in examples} >= {"README.md", "docs/images.md", "docs/grpc.md"}
    with running(tmp_path / "models", tmp_path / "logs", demo=True, ready_timeout=240, env=env) as server:
        assert server.grpc_target is not None
        ports = {"8000": str(server.port), "8001": server.grpc_target.rsplit(":", 1)[1]}
        shell_env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVICE_", "LOADTEST_"))}
        # the reader's shell: the token exported as the README says; locust's gRPC users find the live gRPC
        # port (the text's 8001 is implied by its --host, not written, so the port substitution cannot reach it)
        shell_env.update(HOME=str(workdir), CURL_HOME=str(workdir), SERVICE_ADMIN_TOKEN=token,
                         LOADTEST_GRPC_TARGET=server.grpc_target)
        for block in examples:
            _run(block, ports, workdir, shell_env)


def _run(block: Block, ports: dict[str, str], cwd: Path, env: dict) -> None:
    text = block.body
    for written, live in ports.items():
        text = re.sub(rf"\b(localhost|127\.0\.0\.1):{written}\b", rf"\g<1>:{live}", text)
    command = ["bash", "-e", "-o", "pipefail", "-c", text] if block.shell else [sys.executable, "-c", text]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False)
    where = (f"{block.where()} ({block.lang}):\n{block.body}\nstdout:\n{done.stdout[-3000:]}\n"
             f"stderr:\n{done.stderr[-3000:]}")
    assert done.returncode == 0, f"exit {done.returncode} in {where}"
    for promised in expected_output(block.body):
        assert promised in done.stdout, f"{promised!r} not printed by {where}"
