"""A remote-like object store for the benchmarks: a local directory served as one read-only S3 bucket, with a
per-request latency and a per-connection bandwidth cap.

    python bench/slow_store.py --dir DIR [--latency-ms 30] [--connection-mb-s 100] [--port 0]

or, from a benchmark, ``with slow_store(directory, latency_s=0.03, connection_mb_s=100) as store:``.

Why not moto (bench/s3_server.py): moto keeps each object in its own process's memory and, on a 2-core
machine, moves about 100 MB/s in all; a 10 GB staged dataset would take minutes to upload and most of
this machine's memory to hold, and the store itself, not the path to it, would be measured. A real store
answers each request after tens of milliseconds and serves one connection at tens to hundreds of MB/s
while serving many at once: that is what this server adds, in front of files staging wrote to local disk.

It answers what a streamed run sends: HEAD and GET of an object (with one ``Range``), HEAD of the bucket and
ListObjectsV2 (prefix, delimiter, all in one page). Requests are not authenticated (any credentials pass)
and anything else (a PUT, a DELETE) is refused with 501, so nothing here can change the data. Each
connection is served by a thread of its own (HTTP/1.1 keep-alive, as clients pool them).
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout
from bench.s3_server import free_port  # noqa: E402

BUCKET = "slow-store"
CHUNK = 64 << 10  # bytes sent between two checks of the connection's bandwidth cap
START_TIMEOUT_S = 30
_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


@dataclass
class SlowStore:
    """A running server: its endpoint and what clients need to reach it."""

    endpoint: str
    bucket: str = BUCKET

    @property
    def storage_options(self) -> dict:
        """fsspec's (s3fs's) options for the store."""
        return {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": self.endpoint}}

    @property
    def aws_env(self) -> dict[str, str]:
        """The store through the standard AWS variables, as ``python -m traincore.train`` reads it."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


class Handler(BaseHTTPRequestHandler):
    """One connection's requests: the bucket is the server's ``root`` directory."""

    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a streamed epoch is hundreds of thousands of requests."""

    def _target(self) -> tuple[str, str, dict[str, list[str]]]:
        url = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(url.path).lstrip("/").partition("/")
        return bucket, key, urllib.parse.parse_qs(url.query)

    def _error(self, status: int, code: str, body: bool = True) -> None:
        payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>{code}</Message></Error>").encode() if body else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _answer(self, head: bool) -> None:
        time.sleep(self.server.latency_s)
        bucket, key, query = self._target()
        if bucket != BUCKET:
            return self._error(404, "NoSuchBucket", not head)
        if not key:
            if head:
                return self._error(200, "OK", False)
            return self._list(query)
        path = self.server.root / key
        if not path.is_file():
            return self._error(404, "NoSuchKey", not head)
        self._object(path, head)

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(head=False)

    def _refuse(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self._error(501, "NotImplemented")

    do_PUT = do_POST = do_DELETE = _refuse  # noqa: N815

    def _object(self, path: Path, head: bool) -> None:
        stat = path.stat()
        start, end, status = 0, stat.st_size - 1, 200
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes="):
            first, _, last = ranged[6:].partition("-")
            start, end, status = int(first), min(int(last or end), end), 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("ETag", f'"{stat.st_size:x}{stat.st_mtime_ns:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{stat.st_size}")
        self.end_headers()
        if not head:
            with path.open("rb") as handle:
                handle.seek(start)
                self._send_paced(handle, end - start + 1)

    def _send_paced(self, handle: object, length: int) -> None:
        """Send ``length`` bytes of ``handle`` no faster than the connection's cap."""
        began, sent, rate = time.monotonic(), 0, self.server.connection_bytes_s
        while sent < length:
            chunk = handle.read(min(CHUNK, length - sent))
            self.wfile.write(chunk)
            sent += len(chunk)
            ahead = sent / rate - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)

    def _list(self, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        keys, prefixes = [], set()
        for path in sorted(self.server.root.rglob("*")):
            key = path.relative_to(self.server.root).as_posix()
            if not path.is_file() or not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                keys.append((key, path.stat()))
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><LastModified>"
            f"{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(stat.st_mtime))}</LastModified>"
            f'<ETag>"{stat.st_size:x}{stat.st_mtime_ns:x}"</ETag><Size>{stat.st_size}</Size>'
            "<StorageClass>STANDARD</StorageClass></Contents>" for key, stat in keys)
        common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>"
                         for p in sorted(prefixes))
        body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{_XMLNS}">'
                f"<Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(keys) + len(prefixes)}</KeyCount>"
                f"<MaxKeys>1000000</MaxKeys><Delimiter>{escape(delimiter)}</Delimiter>"
                f"<IsTruncated>false</IsTruncated>{contents}{common}</ListBucketResult>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    """The HTTP server with the store's settings, read by each connection's handler."""

    daemon_threads = True
    request_queue_size = 1024  # a streamed batch opens many connections at once

    def __init__(self, address: tuple[str, int], root: Path, latency_s: float, connection_mb_s: float):
        super().__init__(address, Handler)
        self.root, self.latency_s = root, latency_s
        self.connection_bytes_s = connection_mb_s * 1e6


@contextlib.contextmanager
def slow_store(directory: Path, latency_s: float = 0.03, connection_mb_s: float = 100.0
               ) -> Iterator[SlowStore]:
    """Serve ``directory`` as the bucket from a process of its own (so its work is not the caller's)."""
    port = free_port()
    command = [sys.executable, __file__, "--dir", str(directory), "--port", str(port), "--latency-ms",
               str(latency_s * 1000), "--connection-mb-s", str(connection_mb_s)]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the slow store did not start on port {port} (exit {process.poll()})")
            time.sleep(0.1)
        yield SlowStore(f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        process.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="the directory served as the bucket")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=30.0, help="added before each answer")
    parser.add_argument("--connection-mb-s", type=float, default=100.0, help="each connection's cap")
    args = parser.parse_args(argv)
    server = Server(("127.0.0.1", args.port), args.dir.resolve(), args.latency_ms / 1000,
                    args.connection_mb_s)
    print(f"serving {args.dir} as s3://{BUCKET} on http://127.0.0.1:{server.server_port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
