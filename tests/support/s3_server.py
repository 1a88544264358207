"""A real S3 API on localhost for the remote library tests: moto's server, with a byte counter.

The server runs in the test's process (a thread); pushers and pullers are
other processes that reach it over HTTP with s3fs, as a worker reaches S3.
Every response's body bytes are counted per object key and method, so a
test can show which objects a pull downloaded, independently of what the
pack reports. `truncate` makes the server cut one object's body short (the
connection closes early), as a dropped download would.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple
from urllib.parse import unquote


@dataclass
class Traffic:
    """Body bytes the server sent, per (method, object path) — the path as '/bucket/key'."""

    sent: Dict[Tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, method: str, path: str, size: int) -> None:
        with self.lock:
            self.sent[(method, path)] += size

    def clear(self) -> None:
        with self.lock:
            self.sent.clear()

    def got(self, suffix: str = "") -> Dict[str, int]:
        """GET body bytes per path ending with `suffix`."""
        with self.lock:
            return {path: size for (method, path), size in self.sent.items()
                    if method == "GET" and path.endswith(suffix) and size}

    def total_get(self) -> int:
        return sum(self.got().values())


class _Counting:
    """WSGI middleware: count body bytes of every response; cut the bodies of chosen objects short."""

    def __init__(self, app, traffic: Traffic, truncate: Set[str]):
        self.app, self.traffic, self.truncate = app, traffic, truncate

    def __call__(self, environ, start_response):
        method = environ.get("REQUEST_METHOD", "")
        path = unquote(environ.get("PATH_INFO", ""))
        body = self.app(environ, start_response)
        cut = method == "GET" and any(path.endswith(name) for name in self.truncate)

        def counted():
            sent = 0
            try:
                for chunk in body:
                    if cut and sent + len(chunk) > 64:
                        chunk = chunk[: max(0, 64 - sent)]
                        self.traffic.add(method, path, len(chunk))
                        yield chunk
                        raise ConnectionAbortedError("test: body cut short")
                    sent += len(chunk)
                    self.traffic.add(method, path, len(chunk))
                    yield chunk
            finally:
                close = getattr(body, "close", None)
                if close:
                    close()

        return counted()


class S3Server:
    """moto's S3 on 127.0.0.1 (a free port), counting what it sends."""

    def __init__(self):
        self.traffic = Traffic()
        self.truncate: Set[str] = set()
        self._server = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "S3Server":
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        import logging

        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        app = _Counting(DomainDispatcherApplication(create_backend_app), self.traffic, self.truncate)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def env(self) -> Dict[str, str]:
        """What a pusher or puller process needs to reach this server (any credentials do for moto)."""
        import json

        return {"AWS_ACCESS_KEY_ID": "keepfast-test", "AWS_SECRET_ACCESS_KEY": "keepfast-test",
                "AWS_DEFAULT_REGION": "us-east-1",
                "KEEPFAST_REMOTE_OPTIONS": json.dumps({"endpoint_url": self.endpoint})}

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="keepfast-test",
                     aws_secret_access_key="keepfast-test", region_name="us-east-1").create_bucket(Bucket=name)

    def objects(self, bucket: str) -> List[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="keepfast-test",
                              aws_secret_access_key="keepfast-test", region_name="us-east-1")
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
