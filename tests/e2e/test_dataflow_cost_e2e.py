"""What a large sink argument costs through the wire: the real proxy process (shadow mode, the
default caps) and the mail fixture upstream. A 60 KB argument of "a" (quadratic for the token
scan before it was made linear: 25 s with the event loop blocked) is decided while `/healthz`
keeps answering; an argument longer than `max_argument_chars` is not hashed and is flagged
`coarse` in a run that has read untrusted content.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import mail_policy, mail_server

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

AGENT = token("agent")


def _policy(directory: Path) -> Path:
    return mail_policy(directory, {"mode": "shadow"})  # default caps: 1 MiB per output, 64 KiB per argument


@pytest.fixture(scope="module")
def shadowing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("dataflow-cost")
    with mail_server() as url, proxy_process(tmp, {"mail": url}, policies=_policy(tmp / "policies")) as pp:
        yield pp


async def _call(pp: ProxyProcess, run: str, tool: str, args: dict[str, Any]) -> Any:
    async with mcp_client(pp.url("mail"), "auto", bearer=AGENT, headers={"X-Envelope-Run": run}) as c:
        return await c.call_tool(tool, args)


async def _call_watching_health(pp: ProxyProcess, run: str, args: dict[str, Any]) -> tuple[Any, list[float]]:
    """Send the e-mail while polling the admin `/healthz`; the call's result and how long
    each poll that started before the call finished took."""
    done = asyncio.Event()
    latencies: list[float] = []

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=pp.admin, timeout=30) as http:
            while not done.is_set():
                start = time.monotonic()
                response = await http.get("/healthz")
                assert response.status_code == 200, response.text
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.02)

    poller = asyncio.create_task(poll())
    try:
        result = await _call(pp, run, "send_email", args)
    finally:
        done.set()
        await poller
    return result, latencies


def _sent(pp: ProxyProcess, run: str) -> dict[str, Any]:
    found = [r for r in pp.audit_records() if r["run"] == run and r["tool"] == "send_email"]
    assert len(found) == 1, found
    return found[0]


async def test_a_60_kb_argument_is_decided_while_healthz_answers(shadowing: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    await _call(shadowing, run, "fetch_page", {"url": "https://news.example/q3"})
    body = "a" * 60_000
    result, latencies = await _call_watching_health(
        shadowing, run, {"to": "boss@corp.example", "subject": "Report", "body": body})
    assert not result.is_error, result.content
    assert result.structured_content["sent"] is True
    # The quadratic scan blocked the loop for 25 s; 5 s leaves a loaded CI machine room.
    assert latencies and max(latencies) < 5.0, latencies
    record = _sent(shadowing, run)
    assert record["verdict"] == "allow" and "dataflow" not in record["extra"]  # matched: nothing copied


async def test_an_argument_over_the_cap_is_flagged_coarse_in_shadow(shadowing: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    await _call(shadowing, run, "fetch_page", {"url": "https://news.example/q3"})
    before = metric_value(shadowing.metrics(), "envelope_dataflow_flagged_total",
                          tool="send_email", mode="shadow")
    result, latencies = await _call_watching_health(
        shadowing, run, {"to": "boss@corp.example", "subject": "Dump", "body": "a" * 100_000})
    assert not result.is_error, result.content  # shadow: forwarded, flagged
    # The quadratic scan blocked the loop for 25 s; 5 s leaves a loaded CI machine room.
    assert latencies and max(latencies) < 5.0, latencies
    record = _sent(shadowing, run)
    flow = record["extra"]["dataflow"]
    assert record["verdict"] == "allow" and flow["flagged"] and flow["rule"] == "dataflow.coarse"
    assert flow["evidence"][0]["kind"] == "coarse" and flow["evidence"][0]["argument"] == "/body"
    assert "100,000 characters long" in flow["evidence"][0]["snippet"]
    assert "dataflow.max_argument_chars" in flow["evidence"][0]["snippet"]
    after = metric_value(shadowing.metrics(), "envelope_dataflow_flagged_total",
                         tool="send_email", mode="shadow")
    assert after == before + 1
    # A run that has read nothing untrusted sends the same e-mail unflagged.
    clean = f"run-{uuid.uuid4().hex}"
    again = await _call(shadowing, clean, "send_email",
                        {"to": "boss@corp.example", "subject": "Dump", "body": "a" * 100_000})
    assert not again.is_error and "dataflow" not in _sent(shadowing, clean)["extra"]
