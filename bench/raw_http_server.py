"""No HTTP framework at all: the least any Python HTTP layer could cost on a host (a yardstick, not a server).

    python bench/raw_http_server.py --port 8001 [--reply-floats 1000]

An asyncio BufferedProtocol (uvloop when installed) receives each request straight into one buffer,
finds Content-Length, copies the body out once (the copy a real handler would need) and answers every
request with the same KServe V2 binary response: a ``{}`` JSON header and ``--reply-floats`` float32
zeros. Keep-alive only, no error paths. Used by bench/http_overhead.py (``floor_raw``: what a request
costs without a framework) and bench/service.py (``client_ceiling``: how many requests per second the
load generator itself can send on this host).
"""

from __future__ import annotations

import argparse
import asyncio


def reply(floats: int) -> bytes:
    body = b"{}" + bytes(4 * floats)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: 2\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    return head + body


class RawProtocol(asyncio.BufferedProtocol):
    answer = reply(3)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = bytearray(4 << 20)
        self.view = memoryview(self.buf)
        self.filled = 0  # bytes received and not yet answered
        self.need: int | None = None  # the current request's total size, once its head is parsed

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        searched = max(0, self.filled - 3)  # the head's end may straddle two reads
        self.filled += nbytes
        while True:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n", searched, self.filled)
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                at = head.find(b"content-length:")
                stop = head.find(b"\r\n", at)
                self.need = end + 4 + (0 if at < 0 else int(head[at + 15 : stop if stop > 0 else None]))
                self.body_at = end + 4
            if self.filled < self.need:
                return
            body = bytes(self.view[self.body_at : self.need])  # noqa: F841 - the one copy a handler needs
            self.transport.write(self.answer)  # type: ignore[attr-defined]
            rest = self.filled - self.need
            self.buf[:rest] = self.buf[self.need : self.filled]
            self.filled, self.need, searched = rest, None, 0


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(RawProtocol, "127.0.0.1", port)
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply-floats", type=int, default=3, help="float32 values in every answer")
    args = parser.parse_args()
    RawProtocol.answer = reply(args.reply_floats)
    try:
        import uvloop

        uvloop.run(serve(args.port))
    except ImportError:
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
