"""A session belongs to its principal on every worker, replica and restart, on the wire: the real
proxy process, JWT identities, the scripted upstream (its `initialize` answers session `s-1`).

Before, the binding was in each process's memory: a session id created through one worker was
unknown to the other (`workers: 2` share the port, a new connection lands on either) and to the
process after a restart, and a request carrying an unknown session was relayed, so `mallory`
holding `alice`'s session id reached alice's upstream session. The owner is now kept in the
state store too; a store that cannot say whose a session is refuses (503), never relays.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import write_doc
from hostile_upstream import HostileUpstream
from scripted_upstream import SESSION, scripted_server

from tests.harness import ProxyProcess, metric_value, proxy_process, token, wait_port
from tests.redis_server import running_redis

ALICE = token("alice")
MALLORY = token("mallory")
LEGACY = "2025-11-25"
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
DOC = {"version": 1, "upstreams": {"s": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
       "defaults": {"unknown_tools": "deny"}}


def _post(url: str, bearer: str, method: str, params: dict[str, Any], session: str | None = None) -> httpx.Response:
    headers = {**ACCEPT, "Authorization": f"Bearer {bearer}", "MCP-Protocol-Version": LEGACY}
    if session:
        headers["Mcp-Session-Id"] = session
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    # A new connection per request: with several workers, any of them may take it.
    return httpx.post(url, json=body, headers=headers, timeout=15)


def _initialize(url: str, bearer: str) -> httpx.Response:
    return _post(url, bearer, "initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                             "clientInfo": {"name": "t", "version": "1"}})


def _not_found(response: httpx.Response) -> None:
    assert response.status_code == 404, (response.status_code, response.text)
    assert response.json()["error"]["message"] == "Session not found"


def test_every_worker_knows_whose_a_session_is(tmp_path: Path) -> None:
    with scripted_server() as up, proxy_process(tmp_path, {"s": up.url}, policies=write_doc(tmp_path / "p", DOC),
                                                config={"workers": 2}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)  # the second worker serves too
        url = pp.url("s")
        created = _initialize(url, ALICE)
        assert created.status_code == 200 and created.headers["Mcp-Session-Id"] == SESSION
        # 24 requests on 24 connections: on the old code about half landed on the worker that
        # had not seen the session created, and were relayed into alice's session.
        for _ in range(24):
            _not_found(_post(url, MALLORY, "tools/list", {}, session=SESSION))
        assert up.calls("tools/list") == []  # nothing of mallory's reached the upstream
        for _ in range(8):  # alice's own requests pass on whichever worker takes them
            assert _post(url, ALICE, "tools/list", {}, session=SESSION).status_code == 200
        assert len(up.calls("tools/list")) == 8


def test_a_session_is_its_owners_after_a_restart(tmp_path: Path) -> None:
    policies = write_doc(tmp_path / "p", DOC)
    with scripted_server() as up:
        with proxy_process(tmp_path, {"s": up.url}, policies=policies) as first:
            assert _initialize(first.url("s"), ALICE).headers["Mcp-Session-Id"] == SESSION
        # The same state directory (the embedded SQLite store), a new process: its memory is empty.
        with proxy_process(tmp_path, {"s": up.url}, policies=policies) as second:
            url = second.url("s")
            _not_found(_post(url, MALLORY, "tools/list", {}, session=SESSION))
            assert up.calls("tools/list") == []
            assert metric_value(second.metrics(), "envelope_rejected_requests_total",
                                reason="foreign_session") == 1
            assert _post(url, ALICE, "tools/list", {}, session=SESSION).status_code == 200
            # A session no proxy sharing the store saw created is relayed: its upstream decides.
            assert _post(url, MALLORY, "tools/list", {}, session="s-never-seen").status_code == 200
            # Ended by its owner (the upstream answers 200), the binding goes with it.
            ended = httpx.delete(url, headers={"Authorization": f"Bearer {ALICE}", "Mcp-Session-Id": SESSION,
                                               "MCP-Protocol-Version": LEGACY}, timeout=10)
            assert ended.status_code in (200, 202, 204, 404, 405), ended.text


def test_a_store_that_cannot_say_whose_a_session_is_refuses(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    with running_redis(tmp_path / "redis") as redis, scripted_server() as up, proxy_process(
            tmp_path, {"s": up.url}, policies=write_doc(tmp_path / "p", DOC),
            config={"store": {"kind": "redis", "url": redis.url, "timeout": 1.0}}) as pp:
        url = pp.url("s")
        assert _initialize(url, ALICE).headers["Mcp-Session-Id"] == SESSION
        redis.kill()
        # A session this process knows is still its owner's (memory answers) ...
        assert _post(url, ALICE, "tools/list", {}, session=SESSION).status_code == 200
        _not_found(_post(url, MALLORY, "tools/list", {}, session=SESSION))
        listed = len(up.calls("tools/list"))
        # ... one it does not know is refused, not relayed: whose it is cannot be read.
        unknown = _post(url, MALLORY, "tools/list", {}, session="s-from-another-replica")
        assert unknown.status_code == 503, unknown.text
        assert "owner cannot be read" in unknown.json()["error"]["message"]
        assert len(up.calls("tools/list")) == listed
        # A new session that cannot be bound is not handed out.
        refused = _initialize(url, ALICE)
        assert refused.status_code == 503, refused.text
        assert "Mcp-Session-Id" not in refused.headers
        assert "could not be bound" in refused.json()["error"]["message"]


def test_the_aggregated_endpoint_serves_a_session_on_every_worker_and_only_to_its_owner(tmp_path: Path) -> None:
    # The aggregate answers initialize itself: on the old code a session lived in the worker
    # that created it, so a client whose next request landed on the other worker got 404
    # "Session not found" (the official SDK's client failed mid-session with workers: 2).
    from e2e_helpers import upstream_server, write_policy

    from tests.harness import mcp_client

    policies = write_policy(tmp_path / "policies", {"notes": {}}, tools={"notes.echo": {"effect": "read"}},
                            defaults={"unknown_tools": "deny"}, principals={})
    with upstream_server("json") as up, proxy_process(
            tmp_path, {"notes": up.url}, policies=policies,
            config={"workers": 2, "aggregate": {"enabled": True}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        url = pp.url("notes").rsplit("/", 1)[0]  # .../mcp

        async def sessions() -> list[str]:
            said = []
            for i in range(4):
                async with mcp_client(url, "legacy", bearer=ALICE) as client:
                    for j in range(5):
                        said.append((await client.call_tool("notes.echo", {"text": f"hi {i}.{j}"})).content[0].text)
            return said

        import asyncio
        assert asyncio.run(sessions()) == [f"hi {i}.{j}" for i in range(4) for j in range(5)]
        # Taken up on another worker, a session is still its owner's alone.
        created = _post(url, ALICE, "initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                                   "clientInfo": {"name": "t", "version": "1"}})
        session = created.headers["Mcp-Session-Id"]
        for _ in range(12):
            _not_found(_post(url, MALLORY, "tools/list", {}, session=session))
            assert _post(url, ALICE, "tools/list", {}, session=session).status_code == 200


async def test_an_in_band_answer_reaches_the_worker_that_asked(tmp_path: Path) -> None:
    # The question goes out on the call's stream; the SDK client answers with a POST on another
    # connection, which may land on the other worker. On the old code that worker dropped the
    # answer ("unknown proxy request") and the call ran out its wait: approval_pending.
    from e2e_helpers import upstream_server
    from test_inband_approval_e2e import _policy, answering, client

    with upstream_server("sse") as up, proxy_process(
            tmp_path, {"notes": up.url, "plain": up.url, "rec": up.url}, policies=_policy(tmp_path / "policies"),
            config={"workers": 2, "approvals": {"poll_interval": "100ms"}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        deleted = []
        for i in range(6):
            accept = answering("accept", {"approve": True, "reason": "cleanup"})
            async with client(pp.url("notes"), "legacy", elicitation_callback=accept) as c:
                await c.call_tool("write_note", {"title": f"handed-{i}", "body": "x"})
                r = await c.call_tool("delete_note", {"title": f"handed-{i}"})
                assert r.is_error is False, (i, r.meta)
                deleted.append(r.structured_content)
        assert deleted == [{"deleted": f"handed-{i}", "existed": True} for i in range(6)]
        records = [r for log in pp.worker_audit_records() for r in log]
        allowed = [r for r in records if r["tool"] == "delete_note" and r["verdict"] == "allow"]
        assert len(allowed) == 6 and all(r["extra"]["in_band"] is True for r in allowed), allowed


@contextlib.contextmanager
def _classified(tmp_path: Path) -> Iterator[tuple[ProxyProcess, HostileUpstream]]:
    """Two workers in front of the hostile upstream (and the upstream, whose log tells what
    reached it), whose `read_page` has a redaction of its own (not in `defaults.guardrails`: only
    a result inspected as that tool's is redacted)."""
    from hostile_upstream import hostile_server

    doc = {"version": 1, "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
           "defaults": {"unknown_tools": "deny"},
           "tools": {"h.read_page": {"effect": "read", "output": "untrusted", "guardrails": [
               {"pattern": "CLASSIFIED-[0-9]+", "id": "classified", "action": "redact"}]}}}
    with hostile_server() as up, proxy_process(tmp_path, {"h": up.url}, policies=write_doc(tmp_path / "p", doc),
                                               config={"workers": 2}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        yield pp, up


def test_a_task_result_is_inspected_as_its_tools_on_every_worker(tmp_path: Path) -> None:
    # A task's result is inspected as its tool's (the tool's own guardrails and labels); which
    # tool a task is was known only to the worker that relayed its creation, so on the other
    # worker the result passed as anything an upstream sends: the tool's own redaction skipped.
    # A result no worker knows the tool of is now refused rather than delivered so.
    from test_response_path import Client, text_of

    with _classified(tmp_path) as (pp, _):
        client = Client(pp.url("h"))
        created = client.call("read_page", {"mode": "task", "text": "the code is CLASSIFIED-4471", "delay": 0.1},
                              task={"ttl": 60000})
        task_id = created["result"]["task"]["taskId"]
        close = {"Connection": "close"}  # every request on a new connection: either worker takes it
        for _ in range(10):
            result = client.request("tasks/result", {"taskId": task_id}, close)
            assert "CLASSIFIED-4471" not in text_of(result), result
            assert "[REDACTED:classified]" in text_of(result), result
        unknown = client.request("tasks/result", {"taskId": "task-the-proxy-never-relayed"}, close)
        assert unknown["error"]["code"] == -32602 and "unknown task" in unknown["error"]["message"], unknown


def test_a_resumed_result_is_inspected_as_its_tools_on_every_worker(tmp_path: Path) -> None:
    # The upstream closes the call's stream after priming it; the client resumes with a GET
    # (`Last-Event-ID`) on a new connection, which may land on the other worker. There the call
    # was unknown and its result passed as untrusted content: the tool's own redaction skipped.
    import json as _json

    from test_response_path import Client, sse, text_of

    with _classified(tmp_path) as (pp, _):
        client = Client(pp.url("h"))
        for i in range(8):
            response = client.post({"jsonrpc": "2.0", "id": 100 + i, "method": "tools/call", "params": {
                "name": "read_page", "arguments": {"mode": "drop_resumable", "text": f"code CLASSIFIED-{i}"}}},
                {"Connection": "close"})
            last_id = [e["id"] for e in sse(response.text) if "id" in e][-1]
            resumed = client.http.get(client.url, headers={**client.headers(), "Accept": "text/event-stream",
                                                          "Last-Event-ID": last_id, "Connection": "close"})
            answers = [_json.loads(e["data"]) for e in sse(resumed.text) if e.get("data")]
            result = next(m for m in answers if m.get("id") == 100 + i)
            assert f"CLASSIFIED-{i}" not in text_of(result), (i, result)
            assert "[REDACTED:classified]" in text_of(result), (i, result)
