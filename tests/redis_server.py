"""A real `redis-server` for tests: a free loopback port, a temp dir, no persistence.

Without a `redis-server` binary the tests that need it skip, naming what is missing; with
ENVELOPE_REQUIRE_REDIS=1 (CI) they fail instead.

    with running_redis(tmp_path) as server:   # or the `redis_server` fixture pattern
        store = RedisStore(server.url, ...)
        server.kill(); server.start()          # same port again
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness import free_port


def redis_server_binary() -> str:
    """The redis-server path; skips the test without one (fails under ENVELOPE_REQUIRE_REDIS=1)."""
    found = os.environ.get("ENVELOPE_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    reason = "redis-server not found on PATH (apt-get install -y redis-server)"
    if os.environ.get("ENVELOPE_REQUIRE_REDIS") == "1":
        pytest.fail(f"ENVELOPE_REQUIRE_REDIS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `start` after `kill`/`stop` reuses the same port."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start on the current port (or a free one the first time); wait until it answers PING."""
        for _attempt in range(3):  # a first start tries other ports, a restart the same one again
            port = self.port or free_port()
            log = self.directory / f"redis-{port}.log"
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                 "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _pong(port):
                    self.port = port
                    return
                time.sleep(0.02)
            self._reap(signal.SIGKILL)
            # A restart may race the old socket's release; the first start may lose its port.
            if self.port:
                time.sleep(0.2)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start on port {self.port or port}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL: connections drop at once, as in a crash."""
        self._reap(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM and wait."""
        self._reap(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def _reap(self, sig: signal.Signals) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_redis(directory: Path) -> Iterator[RedisServer]:
    """A started RedisServer in `directory`, stopped on exit (skips when there is no binary)."""
    server = RedisServer(redis_server_binary(), directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()
