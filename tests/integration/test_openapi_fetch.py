"""An OpenAPI document fetched from a URL (`openapi: https://...`), from a real server on
loopback: a server that drips its document never holds the policy load (and with it the reload
lock: every later reload, an operator's emergency edit too, would wait behind it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from proxy.upstream import openapi
from proxy.upstream.openapi import SpecUnreadable, load_spec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def dripping() -> Iterator[str]:
    """A server announcing 100,000 bytes and sending one every 0.2 s (each read gets a byte
    long before the socket timeout)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n")
            while not stop.is_set():
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
                time.sleep(0.2)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/openapi.json"
    finally:
        stop.set()
        server.close()


def test_a_document_dripping_past_the_fetch_timeout_is_unreadable(
        dripping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openapi, "FETCH_TIMEOUT", 1.0)
    with pytest.raises(SpecUnreadable, match=r"cannot fetch the OpenAPI document: not complete within 1s"):
        load_spec(dripping, None)
