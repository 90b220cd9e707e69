"""The KServe infer endpoint without FastAPI's routing and dependency machinery.

Why: on the binary infer path the event loop spent about 1.2 ms of CPU per request, and py-spy put a
third of it in FastAPI/Starlette routing (matching every route's regex), dependency solving and the
wrappers around the endpoint - more than the handler itself. That CPU caps how many requests one
event loop can feed to the GPU. This pure ASGI middleware recognises ``POST /v2/models/{name}[/versions/
{version}]/infer`` and calls the very same handler (``kserve.handle_infer``) directly; errors are
rendered by the same functions as on the routed path. The routed endpoints stay registered, so OpenAPI
and every other method on these paths behave as before.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request

from .errors import exception_response
from .v2 import handle_infer

_INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")

Scope = dict[str, Any]


class InferFastPath:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handle_infer(request, match["name"], match["version"])
        except Exception as exc:
            response = await exception_response(request, exc)
        await response(scope, receive, send)
