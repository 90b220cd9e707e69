"""/docs (Swagger UI) and /redoc work offline: the pages reference no other host, and every script, style
sheet, icon and the OpenAPI document they load comes from this server with the right content type."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest

pytestmark = pytest.mark.anyio

EXPECTED_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


class References(HTMLParser):
    """Every URL a page loads: src/href/spec-url attributes, and the spec URL in Swagger UI's inline script."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self._script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._script = tag == "script"
        self.urls.extend(value for name, value in attrs if name in ("src", "href", "spec-url") and value)

    def handle_data(self, data: str) -> None:
        if self._script:
            self.urls.extend(re.findall(r"\burl: '([^']+)'", data))


@pytest.mark.parametrize(
    ("page", "scripts"), [("/docs", {"swagger-ui-bundle.js"}), ("/redoc", {"redoc.standalone.js"})]
)
async def test_the_docs_pages_load_everything_from_this_server(
    shared: httpx.AsyncClient, page: str, scripts: set[str]
) -> None:
    r = await shared.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "://" not in r.text and not re.search(r"""["'(]//""", r.text), r.text  # no absolute or scheme-less URL
    parser = References()
    parser.feed(r.text)
    assert "/openapi.json" in parser.urls and scripts <= {url.rsplit("/", 1)[-1] for url in parser.urls}
    for url in parser.urls:
        assert url.startswith("/"), url
        asset = await shared.get(url)
        assert asset.status_code == 200, url
        wanted = EXPECTED_TYPES[url[url.rindex("."):]]
        assert asset.headers["content-type"].split(";")[0] == wanted, (url, asset.headers["content-type"])
        assert len(asset.content) > 1000 or url.endswith(".png"), url


async def test_the_assets_are_the_real_bundles(shared: httpx.AsyncClient) -> None:
    swagger = (await shared.get("/docs-assets/swagger-ui-bundle.js")).text
    redoc = (await shared.get("/docs-assets/redoc.standalone.js")).text
    assert "SwaggerUIBundle" in swagger and "Redoc" in redoc
    assert (await shared.get("/docs-assets/favicon.png")).content.startswith(b"\x89PNG")
    assert (await shared.get("/docs-assets/nothing.js")).status_code == 404
