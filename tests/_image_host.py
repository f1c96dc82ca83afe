"""A tiny HTTP/1.1 image host on 127.0.0.1 for the fetch tests (``test_fetch.py``,
``test_vision.py``): it serves an image, redirects to loopback, private and link-local
addresses, sends too much (declared, chunked, or as a gzip bomb), or never answers."""

from __future__ import annotations

import contextlib
import zlib

import trio

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


class Host:
    """A tiny HTTP/1.1 server on 127.0.0.1: ``/path`` → a canned answer."""

    def __init__(self) -> None:
        self.port = 0
        self.requests: list[str] = []
        #: each request's headers (lower-case names), in order
        self.headers: list[dict[str, str]] = []
        self.closed = trio.Event()  # a connection the client closed while the server waited
        self.slow = trio.Event()  # /slow was asked for
        #: more paths to serve, as images
        self.files: dict[str, bytes] = {}

    async def handle(self, stream: trio.SocketStream) -> None:
        # (the client may hang up mid-answer: what a capped fetch does on purpose)
        with contextlib.suppress(trio.BrokenResourceError):
            await self.answer(stream)

    async def answer(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
        head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        path = head[0].split(" ")[1]
        self.requests.append(path)
        self.headers.append(
            {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in head[1:])}
        )
        other = self.port + 1  # (nothing listens there: a redirect to it must not be followed)
        redirects = {
            "/to-loopback": f"http://127.0.0.1:{other}/img",
            "/to-private": "http://10.1.2.3/img",
            "/to-metadata": "http://169.254.169.254/latest/meta-data/",
            "/to-mapped": f"http://[::ffff:127.0.0.1]:{other}/img",
            "/loop": "/loop",
            "/relative": "/img",
        }
        if path in redirects:
            await stream.send_all(
                f"HTTP/1.1 302 Found\r\nLocation: {redirects[path]}\r\nContent-Length: 0\r\n\r\n".encode()
            )
        elif path in self.files:
            body = self.files[path]
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
        elif path == "/img":
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(IMAGE)
                + IMAGE
            )
        elif path == "/big-declared":
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n")
        elif path == "/big-chunked":
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 4096
            for _ in range(64):
                await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await stream.send_all(b"0\r\n\r\n")
        elif path == "/gzip-bomb":
            # 64 MiB of zeros in ~64 KiB, sent gzip-encoded whatever the client asked for
            packer = zlib.compressobj(9, zlib.DEFLATED, 31)
            body = b"".join(packer.compress(bytes(1 << 20)) for _ in range(64)) + packer.flush()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Encoding: gzip\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
        elif path == "/slow":
            self.slow.set()
            try:
                while await stream.receive_some(4096):
                    pass
            finally:
                self.closed.set()
        else:
            await stream.send_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await stream.aclose()
