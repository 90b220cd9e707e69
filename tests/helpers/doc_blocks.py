"""The fenced blocks of the repository's pages (README.md, every docs/*.md, loadtests/README.md), as the doc
tests read them.

A block is an *example* when its language is ``bash``, ``sh`` or ``python``: tests/e2e/test_doc_examples.py
runs every example against a live server, unless a marker on the line right above its fence says why not:

- ``<!-- not run: ... -->``: it starts the server or the test suite (the test is that server);
- ``<!-- needs: kubernetes -->`` or ``<!-- needs: docker -->``: it needs a cluster or a Docker daemon.
  tests/unit/test_doc_blocks.py checks what can be checked without one: the kustomizations it applies
  render (``kubectl kustomize``), the compose file, profiles and services it names exist, the build context
  has its Dockerfile.

``yaml`` blocks are parsed; a block without a language is text (a tree, a query), never a command.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOURNEY = ("README.md", "docs/images.md", "docs/grpc.md")
"""The pages a new user follows first, in this order (the e2e test runs them so, on one server)."""
SHELLS = ("bash", "sh")
NEEDS = ("kubernetes", "docker")
STARTS = ("scripts/serve.sh", "scripts/test.sh", "python -m service serve")
FENCE = re.compile(
    r"(?:^[ \t]*<!-- (?P<kind>not run|needs): (?P<why>[^>]*?) -->\n)?"
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    marker: str | None = None
    """``not run`` or ``needs``; None when the block has no marker."""
    why: str = ""

    @property
    def shell(self) -> bool:
        return self.lang in SHELLS

    @property
    def example(self) -> bool:
        return self.shell or self.lang == "python"

    @property
    def runs(self) -> bool:
        return self.example and self.marker is None

    @property
    def needs(self) -> str | None:
        return self.why if self.marker == "needs" else None

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """Every page with examples, the new user's path first (``JOURNEY``), then the other docs, then the load
    tests' README (which loads the server that the others leave behind)."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return [*JOURNEY, *(page for page in docs if page not in JOURNEY), "loadtests/README.md"]


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` in order, their text without the indentation of the fence."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        indent = match["indent"]
        body = "".join(line.removeprefix(indent) for line in match["body"].splitlines(keepends=True))
        line = text.count("\n", 0, match.start("indent")) + 1
        found.append(Block(page, line, match["lang"], body, match["kind"], (match["why"] or "").strip()))
    return found


def commands(body: str) -> list[str]:
    """The shell commands of a block: comments dropped, continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
