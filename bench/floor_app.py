"""The HTTP floor: a bare ASGI app on uvicorn that reads a request body and answers at once.

Used by bench/http_overhead.py and bench/server_cpu.py as the least a uvicorn server can cost per request.
It answers like the light model (GlobalAveragePool over [N, 3, 224, 224]): 3 floats per 600 KB sample as
a KServe binary reply, with Content-Length (as the service sends it; the raw load generator needs it).
``FLOOR_BODY_BUFFER`` (bytes), when set, is uvicorn's body buffer, as service/server/process.py sets
it in the service.

    python bench/floor_app.py --port PORT       # or: granian --interface asgi floor_app:app
"""

from __future__ import annotations

import os
import sys

SAMPLE_BYTES = 3 * 224 * 224 * 4


async def app(scope, receive, send):  # plain ASGI
    if scope["type"] != "http":
        return
    body = bytearray()
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    reply = b"{}" + bytes(12 * max(1, len(body) // SAMPLE_BYTES))
    headers = [(b"content-type", b"application/octet-stream"), (b"inference-header-content-length", b"2"),
               (b"content-length", str(len(reply)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": reply})


def main() -> None:
    import uvicorn
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    if os.environ.get("FLOOR_BODY_BUFFER"):
        httptools_impl.HIGH_WATER_LIMIT = int(os.environ["FLOOR_BODY_BUFFER"])
    port = int(sys.argv[sys.argv.index("--port") + 1])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http="httptools")


if __name__ == "__main__":
    main()
