"""A misbehaving S3 server on 127.0.0.1 for tests of what a store does with answers that never end.

``HostileS3(mode)``: ``new-token`` answers every ListObjectsV2 with a truncated page and a new
continuation token, ``same-token`` with the same token every time (``page_delay_s`` before each
page); ``trickle-headers`` answers a GET one byte a second from its status line on,
``trickle-body`` sends the headers of a 1 MiB answer and then its body a byte a second (in these
two modes a listing shows one object, ``f``, of that size, and a HEAD of anything describes it). ``pages``
counts the listing pages served; ``gone`` is set when a trickled-to client closed its connection.
Plain ``http.server`` threads, stopped (bounded) on exit.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

BUCKET = "hostile"
WAIT_S = 10.0  # bound on waiting for the server's thread, and for it to see a client go
ENVIRON = {"AWS_ACCESS_KEY_ID": "AKIDHOSTILETEST", "AWS_SECRET_ACCESS_KEY": "hostile-test-secret",
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def list_page(token: str, n: int) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix>d/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>/</Delimiter><IsTruncated>true</IsTruncated>"
            f"<Contents><Key>d/f{n}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f'<ETag>"e{n}"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>'
            f"<NextContinuationToken>{token}</NextContinuationToken></ListBucketResult>").encode()


FILE_SIZE = 1048576  # the trickled object's size: one block


def one_file_page() -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix></Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<Delimiter>/</Delimiter><IsTruncated>false</IsTruncated>"
            f"<Contents><Key>f</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f'<ETag>"e"</ETag><Size>{FILE_SIZE}</Size><StorageClass>STANDARD</StorageClass></Contents>'
            f"</ListBucketResult>").encode()


class HostileS3:
    """``mode``: ``new-token``/``same-token`` (listings), ``trickle-headers``/``trickle-body`` (GETs)."""

    def __init__(self, mode: str, page_delay_s: float = 0.0) -> None:
        self.mode = mode
        self.page_delay_s = page_delay_s
        self.pages = 0
        self.gone = threading.Event()  # a trickled-to client closed its connection
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Length", str(FILE_SIZE))
                self.send_header("ETag", '"e"')
                self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                query = parse_qs(urlsplit(self.path).query)
                if "list-type" in query and outer.mode.startswith("trickle"):
                    body = one_file_page()  # one object, "f", whose GET trickles
                    self.send_response(200)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if "list-type" in query:
                    outer.pages += 1
                    time.sleep(outer.page_delay_s)
                    token = "same" if outer.mode == "same-token" else uuid.uuid4().hex
                    body = list_page(token, outer.pages)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                head = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1048576\r\nETag: \"e\"\r\n\r\n"
                if outer.mode == "trickle-body":
                    self.wfile.write(head)
                    head = b"x" * 1048576
                try:
                    for byte in head:
                        if outer.stop.is_set():
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        if outer.stop.wait(1.0):
                            return
                except OSError:
                    outer.gone.set()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HostileS3:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(WAIT_S)
