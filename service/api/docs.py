"""The interactive API documentation, offline: Swagger UI at ``/docs`` and ReDoc at ``/redoc``.

FastAPI's own pages load their scripts, styles and favicon from a CDN, so they stay blank on a host without
internet access. These pages load the same Swagger UI and ReDoc bundles from this server, under ``ASSETS``:
the copies the ``fastapi-offline`` package ships (kept current with Swagger UI 5 and ReDoc 2 by its
maintainer). Neither page references any other host (ReDoc without Google Fonts).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS = "/docs-assets"
ASSET_PACKAGE = ("fastapi_offline", "static")
"""(package, folder): swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png."""


def install_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve both pages and their assets; the app must be built with ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS, StaticFiles(packages=[ASSET_PACKAGE]), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    app.add_api_route(docs_url, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(redoc_url, redoc, methods=["GET"], include_in_schema=False)
