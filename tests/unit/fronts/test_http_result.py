"""An HTTP upstream's answer becomes a tool result off the event loop when it is large.

`forwarded._http_result` decodes and parses on the loop only what costs less than a thread hop;
a large or content-coded body (tens of milliseconds for 16 MiB) is handed to a worker thread,
with the same result either way.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from typing import Any

import orjson
import pytest

from proxy.errors import ReplyTooLarge
from proxy.fronts import forwarded
from proxy.upstream import openapi


def _threads_used(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []

    def spy(status: int, ctype: str, body: bytes) -> dict[str, Any]:
        seen.append(threading.get_ident())
        return openapi.result_from(status, ctype, body)

    monkeypatch.setattr(forwarded, "result_from", spy)
    return seen


def _run(status: int, body: bytes, coding: str = "", limit: int = 1 << 26) -> tuple[bytes, dict[str, Any]]:
    async def main() -> tuple[bytes, dict[str, Any]]:
        return await forwarded._http_result(status, "application/json", body, coding, limit)
    return asyncio.run(main())


def test_a_small_answer_is_parsed_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _threads_used(monkeypatch)
    body = orjson.dumps({"id": 7, "name": "rex"})
    data, result = _run(200, body)
    assert data == body
    assert result["structuredContent"] == {"id": 7, "name": "rex"}
    assert seen == [threading.get_ident()]


def test_a_large_answer_is_parsed_in_a_worker_thread_with_the_same_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    body = orjson.dumps({"items": [{"id": i, "note": "x" * 40} for i in range(4000)]})
    assert len(body) > forwarded.INLINE_HTTP_BYTES
    seen = _threads_used(monkeypatch)
    data, result = _run(200, body)
    assert seen and seen[0] != threading.get_ident()
    assert data == body
    assert result == openapi.result_from(200, "application/json", body)
    assert len(result["structuredContent"]["items"]) == 4000


def test_a_gzip_answer_is_decoded_off_the_loop_and_its_cap_still_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = orjson.dumps({"ok": True, "pad": "y" * 1000})
    seen = _threads_used(monkeypatch)
    data, result = _run(200, gzip.compress(plain), "gzip")
    assert data == plain and result["structuredContent"]["ok"] is True
    assert seen and seen[0] != threading.get_ident()
    # A small bomb is refused from the thread exactly as inline: past the cap, never inflated.
    with pytest.raises(ReplyTooLarge):
        _run(200, gzip.compress(b"0" * 100_000), "gzip", limit=10_000)
    with pytest.raises(ValueError, match="does not decode"):
        _run(200, b"not gzip at all", "gzip")
