"""Approvals through the wire: the real proxy process, the official SDK client, the demo notes
server (its `delete_note` answers `existed`, so a second deletion would show), the admin API,
the `envelope-proxy approvals` CLI and a webhook receiver.

Several policy upstreams point at the same demo server, each with its own approval settings:
`notes` (refused as pending at once), `held` (holds calls for 10 s), `short` (1 s TTL), `gated`
(an external writer, for grants) and `flaky` (its webhook deliveries fail twice).

Concurrent duplicates of one approved call go to two replicas sharing one SQLite store in front of
a counting upstream (`fake_upstream`): exactly one performs it, the others replay its result.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import cli, upstream_server, write_doc
from fake_upstream import FakeUpstream, fake_upstream

from tests.harness import (
    ProxyProcess,
    free_port,
    mcp_client,
    metric_value,
    proxy_process,
    token,
)

OPS = token("ops", tenant="acme")
ALICE_TOKEN = "alice-approver-token"
OPS_APPROVER_TOKEN = "ops-approver-token"  # an approver who is also the calling principal
# Approvers whose names read as the calling principal's (`ops`): another case, fullwidth letters.
OPS_AS_READ = {"Ops": "cased-ops-approver-token", "\uff2f\uff30\uff33": "fullwidth-ops-approver-token"}
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}


class Receiver:
    """A webhook receiver on loopback (own thread): records notifications; fails the first two
    deliveries of each approval on upstream `flaky`."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.attempts: dict[str, int] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = receiver.attempts[body["id"]] = receiver.attempts.get(body["id"], 0) + 1
                failing = body["upstream"] == "flaky" and n <= 2
                if not failing:
                    receiver.received.append(body)
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _policy(directory: Path) -> Path:
    notes_tools = {
        "write_note": {"effect": "write"},
        "search_notes": {"effect": "read"},
    }
    tools: dict[str, Any] = {}
    for upstream, approval in {
        "notes": {"required": True, "wait": "0s"},
        "held": {"required": True, "wait": "10s"},
        "short": {"required": True, "wait": "0s", "ttl": "1s"},
        "flaky": {"required": True, "wait": "0s"},
    }.items():
        tools[f"{upstream}.delete_note"] = {"effect": "destructive", "approval": approval}
        for name, entry in notes_tools.items():
            tools[f"{upstream}.{name}"] = entry
    tools["gated.write_note"] = {"effect": "external", "approval": {"required": True, "wait": "0s"}}
    doc = {
        "version": 1,
        "upstreams": {u: {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}
                      for u in ("notes", "held", "short", "flaky", "gated")},
        "defaults": {"unknown_tools": "deny"},
        "tools": tools,
    }
    return write_doc(directory, doc)


class World:
    def __init__(self, proxy: ProxyProcess, receiver: Receiver):
        self.proxy = proxy
        self.receiver = receiver


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("approvals")
    receiver = Receiver()
    try:
        with upstream_server("sse") as up:
            upstreams = {u: up.url for u in ("notes", "held", "short", "flaky", "gated")}
            config = {"approvals": {
                "poll_interval": "100ms",
                "approvers": {
                    "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()},
                    "ops": {"token_env": "OPS_APPROVER_TOKEN"},
                    **{name: {"token_sha256": hashlib.sha256(secret.encode()).hexdigest()}
                       for name, secret in OPS_AS_READ.items()},
                },
                "webhook": {"url": f"http://127.0.0.1:{receiver.port}/hook", "timeout": "2s",
                            "attempts": 3, "backoff": "50ms"},
            }}
            with proxy_process(tmp, upstreams, policies=_policy(tmp / "policies"), config=config,
                               env={"OPS_APPROVER_TOKEN": OPS_APPROVER_TOKEN}) as pp:
                yield World(pp, receiver)
    finally:
        receiver.close()


# -- helpers ----------------------------------------------------------------------------------


async def call(world: World, upstream: str, tool: str, args: dict[str, Any]) -> Any:
    async with mcp_client(world.proxy.url(upstream), "auto", bearer=OPS) as c:
        return await c.call_tool(tool, args)


def decision(result: Any) -> dict[str, Any]:
    return dict((result.meta or {})["envelope/decision"])


def record(world: World, decision_id: str) -> dict[str, Any]:
    found = [r for r in world.proxy.audit_records() if r["decision_id"] == decision_id]
    assert len(found) == 1, found
    return found[0]


def last_record(world: World, upstream: str, tool: str) -> dict[str, Any]:
    return [r for r in world.proxy.audit_records() if (r["upstream"], r["tool"]) == (upstream, tool)][-1]


async def admin(world: World, method: str, path: str, headers: dict[str, str] | None = None,
                **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=world.proxy.admin, timeout=10) as http:
        return await http.request(method, path, headers=ALICE if headers is None else headers, **kw)


async def pending_for(world: World, upstream: str, title: str, within: float = 5.0) -> dict[str, Any]:
    """The pending approval of the call deleting/writing `title` on `upstream`."""
    for _ in range(int(within / 0.05)):
        r = await admin(world, "GET", "/v1/approvals?state=pending")
        assert r.status_code == 200, r.text
        found = [a for a in r.json()["approvals"]  # (arguments cut in the list: null)
                 if a["upstream"] == upstream and (a["arguments"] or {}).get("title") == title]
        if found:
            assert len(found) == 1
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no pending approval for {upstream} {title}")


def assert_refused(result: Any, code: str) -> dict[str, Any]:
    assert result.is_error is True
    meta = decision(result)
    assert meta["code"] == code, meta
    assert meta["check"] == "approval"
    assert result.content[0].text == f"Blocked by policy ({code}): {meta['reason']}"
    return meta


async def write(world: World, upstream: str, title: str) -> None:
    r = await call(world, upstream, "write_note", {"title": title, "body": "b"})
    assert r.is_error is False, r


# -- tests ------------------------------------------------------------------------------------


async def test_held_call_released_by_an_approval_while_it_waits(world: World) -> None:
    await write(world, "held", "h1")
    held = asyncio.create_task(call(world, "held", "delete_note", {"title": "h1"}))
    approval = await pending_for(world, "held", "h1")
    assert approval["principal"] == "ops" and approval["tool"] == "delete_note"
    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", json={"reason": "cleanup"})
    assert r.status_code == 200, r.text
    result = await asyncio.wait_for(held, 10)
    assert result.is_error is False
    assert result.structured_content == {"deleted": "h1", "existed": True}
    rec = last_record(world, "held", "delete_note")
    assert rec["verdict"] == "allow" and rec["upstream_status"] == 200
    assert rec["extra"]["approval_id"] == approval["id"]
    assert rec["extra"]["approver"] == "alice"
    shown = (await admin(world, "GET", f"/v1/approvals/{approval['id']}")).json()
    assert (shown["state"], shown["approver"], shown["decision_reason"]) == ("consumed", "alice", "cleanup")


async def test_pending_then_retried_after_approval_forwarded_exactly_once(world: World) -> None:
    await write(world, "notes", "p1")
    first = await call(world, "notes", "delete_note", {"title": "p1"})
    meta = assert_refused(first, "approval_pending")
    approval = await pending_for(world, "notes", "p1")
    assert approval["id"] in meta["reason"]
    assert "retry the same call after approval" in meta["reason"]
    rec = record(world, meta["decision_id"])
    assert (rec["code"], rec["extra"]["approval_id"]) == ("approval_pending", approval["id"])

    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", json={"reason": "ok"})
    assert r.status_code == 200
    retried = await call(world, "notes", "delete_note", {"title": "p1"})
    assert retried.structured_content == {"deleted": "p1", "existed": True}
    again = await call(world, "notes", "delete_note", {"title": "p1"})
    # Not performed twice: had it reached the server, `existed` would now be false.
    assert again.structured_content == {"deleted": "p1", "existed": True}
    performed = [r for r in world.proxy.audit_records()
                 if (r["upstream"], r["tool"]) == ("notes", "delete_note")
                 and r["args_digest"] == rec["args_digest"] and r["upstream_status"] == 200]
    assert len(performed) == 1, performed
    assert performed[0]["extra"]["approver"] == "alice"


async def test_legacy_retry_from_a_new_session_is_a_new_run(world: World) -> None:
    # The README's tour, step 5, in legacy mode: the run is the MCP session, so an approval
    # covers retries in the same session only; a new process (session) asks anew.
    await write(world, "notes", "legacy-run")
    async with mcp_client(world.proxy.url("notes"), "legacy", bearer=OPS) as first_session:
        assert_refused(await first_session.call_tool("delete_note", {"title": "legacy-run"}), "approval_pending")
        approval = await pending_for(world, "notes", "legacy-run")
        r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", json={"reason": "ok"})
        assert r.status_code == 200
        async with mcp_client(world.proxy.url("notes"), "legacy", bearer=OPS) as new_session:
            elsewhere = await new_session.call_tool("delete_note", {"title": "legacy-run"})
        meta = assert_refused(elsewhere, "approval_pending")
        assert approval["id"] not in meta["reason"]  # its own approval, not the one granted
        retried = await first_session.call_tool("delete_note", {"title": "legacy-run"})
        assert retried.structured_content == {"deleted": "legacy-run", "existed": True}


async def test_denied_call_shows_the_approvers_reason(world: World) -> None:
    first = await call(world, "notes", "delete_note", {"title": "welcome"})
    assert_refused(first, "approval_pending")
    approval = await pending_for(world, "notes", "welcome")
    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/deny",
                    json={"reason": "the welcome note stays"})
    assert r.status_code == 200 and r.json()["state"] == "denied"
    denied = await call(world, "notes", "delete_note", {"title": "welcome"})
    meta = assert_refused(denied, "approval_denied")
    assert "denied by alice: the welcome note stays" in denied.content[0].text
    assert record(world, meta["decision_id"])["extra"]["approver"] == "alice"
    search = await call(world, "notes", "search_notes", {"query": "welcome"})
    assert search.structured_content["result"]  # still there


async def test_expired_approval(world: World) -> None:
    assert_refused(await call(world, "short", "delete_note", {"title": "e1"}), "approval_pending")
    approval = await pending_for(world, "short", "e1")
    await asyncio.sleep(1.3)
    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", json={"reason": "late"})
    assert r.status_code == 409
    meta = assert_refused(await call(world, "short", "delete_note", {"title": "e1"}), "approval_expired")
    assert approval["id"] in meta["reason"]
    listed = (await admin(world, "GET", "/v1/approvals?state=expired")).json()["approvals"]
    assert approval["id"] in [a["id"] for a in listed]


async def test_self_approval_is_refused(world: World) -> None:
    assert_refused(await call(world, "notes", "delete_note", {"title": "s1"}), "approval_pending")
    approval = await pending_for(world, "notes", "s1")
    mine = {"Authorization": f"Bearer {OPS_APPROVER_TOKEN}"}
    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", headers=mine,
                    json={"reason": "trust me"})
    assert r.status_code == 403
    assert "cannot decide a call made by ops" in r.json()["error"]
    r = await admin(world, "GET", "/v1/approvals", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    # The CLI says the same.
    out = cli("approvals", "--admin", world.proxy.admin, "approve", approval["id"], "--reason", "me",
              env={**os.environ, "ENVELOPE_APPROVER_TOKEN": OPS_APPROVER_TOKEN})
    assert out.returncode == 1
    assert "403" in out.stderr and "cannot decide a call made by ops" in out.stderr


@pytest.mark.parametrize("name", list(OPS_AS_READ), ids=["another case", "fullwidth"])
async def test_an_approver_whose_name_reads_as_the_callers_is_the_caller(world: World, name: str) -> None:
    # Names were compared exactly: approver `Ops` approved (and so performed) a call of `ops`.
    title = f"as-read-{list(OPS_AS_READ).index(name)}"
    assert_refused(await call(world, "notes", "delete_note", {"title": title}), "approval_pending")
    approval = await pending_for(world, "notes", title)
    theirs = {"Authorization": f"Bearer {OPS_AS_READ[name]}"}
    for verb in ("approve", "deny"):
        r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/{verb}", headers=theirs,
                        json={"reason": "trust me"})
        assert r.status_code == 403, r.text
        assert r.json()["error"] == (f"{name} cannot decide a call made by ops: the same name to the "
                                     "self-approval rule (compared ignoring case, width and invisible "
                                     "characters)")
    refused = [r for r in world.proxy.audit_records() if r.get("method") == "<approval>"
               and r["extra"]["approval_id"] == approval["id"]]
    assert [(r["extra"]["decision"], r["extra"]["approver"], r["extra"].get("refused"))
            for r in refused] == [("approved", name, True), ("denied", name, True)]
    r = await admin(world, "GET", f"/v1/approvals/{approval['id']}")
    assert (r.json()["state"], r.json()["approver"]) == ("pending", None)
    # Still waiting for a person who did not make it: the call is refused again, not performed.
    assert_refused(await call(world, "notes", "delete_note", {"title": title}), "approval_pending")


async def test_grant_releases_later_matching_calls_without_waiting(world: World) -> None:
    first = await call(world, "gated", "write_note", {"title": "g1", "body": "b", "folder": "drafts"})
    assert_refused(first, "approval_pending")
    approval = await pending_for(world, "gated", "g1")
    r = await admin(world, "POST", f"/v1/approvals/{approval['id']}/approve", json={
        "reason": "drafts are fine", "grant": {"scope": "tool", "args": {"folder": "drafts"}, "duration": "30m"},
    })
    assert r.status_code == 200, r.text
    grant = r.json()["grant"]
    started = time.monotonic()
    second = await call(world, "gated", "write_note", {"title": "g2", "body": "b", "folder": "drafts"})
    assert second.is_error is False and second.structured_content["saved"] == "g2"
    assert time.monotonic() - started < 5
    rec = last_record(world, "gated", "write_note")
    assert rec["verdict"] == "allow" and rec["extra"]["grant_id"] == grant["id"]
    assert rec["extra"]["approver"] == "alice"
    other = await call(world, "gated", "write_note", {"title": "g3", "body": "b", "folder": "inbox"})
    assert_refused(other, "approval_pending")
    grants = (await admin(world, "GET", "/v1/grants")).json()["grants"]
    assert [g["id"] for g in grants] == [grant["id"]]


async def test_approval_through_the_cli(world: World) -> None:
    await write(world, "notes", "c1")
    assert_refused(await call(world, "notes", "delete_note", {"title": "c1"}), "approval_pending")
    approval = await pending_for(world, "notes", "c1")
    env = {**os.environ, "ENVELOPE_APPROVER_TOKEN": ALICE_TOKEN}
    listed = cli("approvals", "--admin", world.proxy.admin, "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert approval["id"] in listed.stdout and "ops -> notes.delete_note" in listed.stdout
    shown = cli("approvals", "show", approval["id"], "--admin", world.proxy.admin, env=env)
    assert json.loads(shown.stdout)["arguments"] == {"title": "c1"}
    done = cli("approvals", "--admin", world.proxy.admin, "--token", ALICE_TOKEN, "approve",
               approval["id"], "--reason", "via the cli")
    assert done.returncode == 0, done.stderr
    assert f"{approval['id']} approved by alice: via the cli" in done.stdout
    result = await call(world, "notes", "delete_note", {"title": "c1"})
    assert result.structured_content == {"deleted": "c1", "existed": True}
    assert last_record(world, "notes", "delete_note")["extra"]["approval_id"] == approval["id"]
    missing = cli("approvals", "--admin", world.proxy.admin, "show", "apr-nope", env=env)
    assert missing.returncode == 1 and "404" in missing.stderr


async def test_large_arguments_are_cut_in_the_list_and_whole_by_id(world: World) -> None:
    big = {"title": "big-" + "x" * 2**20}  # 1 MiB of arguments
    refused = assert_refused(await call(world, "notes", "delete_note", big), "approval_pending")
    approval_id = record(world, refused["decision_id"])["extra"]["approval_id"]
    size = len(json.dumps(big, separators=(",", ":")).encode())
    try:
        r = await admin(world, "GET", "/v1/approvals?state=pending")
        assert r.status_code == 200, r.text
        assert len(r.content) < 64 * 1024  # the answer is small (on main: over 2 MB)
        [listed] = [a for a in r.json()["approvals"] if a["id"] == approval_id]
        assert (listed["arguments_truncated"], listed["arguments_bytes"]) == (True, size)
        assert listed["arguments"] is None and listed["hidden_characters"] is None
        assert listed["arguments_text"].startswith('{\n  "title": "big-xxx')
        assert len(listed["arguments_text"].encode()) <= 8 * 1024
        whole = (await admin(world, "GET", f"/v1/approvals/{approval_id}")).json()
        assert (whole["arguments"], whole["arguments_truncated"], whole["arguments_bytes"]) == (big, False, size)
        assert json.loads(whole["arguments_text"]) == big
        # The CLI: `list --json` says the list cut them, `show` prints them whole.
        env = {**os.environ, "ENVELOPE_APPROVER_TOKEN": ALICE_TOKEN}
        listed_cli = cli("approvals", "--admin", world.proxy.admin, "list", "--json", env=env)
        assert listed_cli.returncode == 0, listed_cli.stderr
        assert "cuts large arguments" in listed_cli.stderr and "`show ID`" in listed_cli.stderr
        shown = cli("approvals", "show", approval_id, "--admin", world.proxy.admin, env=env)
        assert json.loads(shown.stdout)["arguments"] == big
    finally:
        r = await admin(world, "POST", f"/v1/approvals/{approval_id}/deny", json={"reason": "test done"})
        assert r.status_code == 200, r.text


async def test_webhook_notified_and_failures_retried_and_counted(world: World) -> None:
    assert_refused(await call(world, "notes", "delete_note", {"title": "w1"}), "approval_pending")
    approval = await pending_for(world, "notes", "w1")
    for _ in range(100):
        sent = [n for n in world.receiver.received if n["id"] == approval["id"]]
        if sent:
            break
        await asyncio.sleep(0.05)
    assert len(sent) == 1
    note = sent[0]
    assert {k: note[k] for k in ("type", "principal", "upstream", "tool", "args_digest")} == {
        "type": "approval.created", "principal": "ops", "upstream": "notes", "tool": "delete_note",
        "args_digest": approval["args_digest"]}
    assert note["run"] == approval["run"] and note["expires_at"] == approval["expires_at"]
    assert note["reason"] and note["review_url"] == f"{world.proxy.admin}/v1/approvals/{approval['id']}"

    before = metric_value(world.proxy.metrics(), "envelope_approval_webhook_failures_total")
    assert_refused(await call(world, "flaky", "delete_note", {"title": "f1"}), "approval_pending")
    flaky = await pending_for(world, "flaky", "f1")
    for _ in range(100):
        if any(n["id"] == flaky["id"] for n in world.receiver.received):
            break
        await asyncio.sleep(0.05)
    assert world.receiver.attempts[flaky["id"]] == 3  # two failures, then delivered
    after = metric_value(world.proxy.metrics(), "envelope_approval_webhook_failures_total")
    assert after - before == 2
    assert metric_value(world.proxy.metrics(), "envelope_approvals_pending") >= 1


# -- concurrent duplicates of one approved call --------------------------------------------------

COUNTED_WAIT = 1.0  # idempotency.wait: how long a duplicate waits for the first call
FILLER = 300  # pending approvals already stored: the pending gauge scans them after a consume


@dataclass
class Replicas:
    """Two proxy processes sharing one SQLite store, in front of one counting upstream."""

    a: ProxyProcess
    b: ProxyProcess
    fake: FakeUpstream

    def record(self, decision_id: str) -> dict[str, Any]:
        found = [r for pp in (self.a, self.b) for r in pp.audit_records()
                 if r["decision_id"] == decision_id]
        assert len(found) == 1, found
        return found[0]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("approvals-replicas")
    doc = {
        "version": 1,
        "upstreams": {"counted": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "counted.delete_note": {"effect": "destructive",
                                    "approval": {"required": True, "wait": "0s"}},
            "counted.purge": {"effect": "destructive", "approval": {"required": True, "wait": "10s"}},
        },
    }
    config = {
        "store": {"kind": "sqlite", "path": str(tmp / "shared.db")},
        "approvals": {"poll_interval": "50ms", "approvers": {
            "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}}},
        "idempotency": {"wait": COUNTED_WAIT},
    }
    policies = write_doc(tmp / "policies", doc)
    static = {"mode": "static", "principal": "agent"}
    for replica in ("a", "b"):
        (tmp / replica).mkdir()
    with fake_upstream() as fake, \
            proxy_process(tmp / "a", {"counted": fake.url}, policies=policies, identity=static,
                          config=config) as a, \
            proxy_process(tmp / "b", {"counted": fake.url}, policies=policies, identity=static,
                          config=config) as b:
        world = Replicas(a, b, fake)
        asyncio.run(_fill(world))
        yield world


async def _fill(world: Replicas) -> None:
    """A busy deployment: many approvals waiting for a decision."""
    for start in range(0, FILLER, 50):
        results = await asyncio.gather(*(_together(world, "delete_note", f"filler-{i}", 1)
                                         for i in range(start, start + 50)))
        assert {code(r) for [r] in results} == {"approval_pending"}


def code(result: dict[str, Any]) -> str:
    """The envelope's decision code of a result: "ok" for one the upstream gave (no decision)."""
    return str(result.get("_meta", {}).get("envelope/decision", {}).get("code", "ok"))


async def _together(world: Replicas, tool: str, title: str, n: int) -> list[dict[str, Any]]:
    """`n` identical calls (one run) sent at once, alternately to each replica; their tool
    results, in order."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": tool, "arguments": {"title": title}}})
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2026-07-28", "X-Envelope-Run": f"run-{title}"}
    urls = [(world.a, world.b)[i % 2].url("counted") for i in range(n)]
    async with httpx.AsyncClient(timeout=20) as client:
        replies = await asyncio.gather(*(client.post(url, content=body, headers=headers)
                                         for url in urls))
    results = []
    for r in replies:
        assert r.status_code == 200, r.text
        results.append(r.json()["result"])
    return results


async def _approve(world: Replicas, title: str) -> str:
    async with httpx.AsyncClient(base_url=world.a.admin, timeout=10) as http:
        for _ in range(200):
            listed = (await http.get("/v1/approvals?state=pending", headers=ALICE)).json()
            found = [a for a in listed["approvals"] if a["arguments"] == {"title": title}]
            if found:
                r = await http.post(f"/v1/approvals/{found[0]['id']}/approve", headers=ALICE,
                                    json={"reason": "go"})
                assert r.status_code == 200, r.text
                return str(found[0]["id"])
            await asyncio.sleep(0.05)
    raise AssertionError(f"no pending approval for {title}")


def _performed_once(world: Replicas, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result performed, every other one its replay, never `approval_expired`; the
    performing call's audit record."""
    codes = sorted(map(code, results))
    assert codes == ["ok"] + ["replayed"] * (len(results) - 1), [r.get("_meta") for r in results]
    [first] = [r for r in results if code(r) == "ok"]
    sources = set()
    for r in results:
        assert (r["content"], r["structuredContent"], r["isError"]) == (
            first["content"], first["structuredContent"], False)
        if r is not first:
            rec = world.record(r["_meta"]["envelope/decision"]["decision_id"])
            assert rec["code"] == "replayed"
            sources.add(rec["extra"]["replayed_from"])
    [first_id] = sources
    performed = world.record(first_id)
    assert (performed["code"], performed["upstream_status"]) == ("ok", 200)
    return performed


async def test_duplicates_after_one_approval_reach_the_upstream_once(replicas: Replicas) -> None:
    fake = replicas.fake
    for n in range(3):  # a few rounds: each is one chance for the race
        title = f"d1-{n}"
        [first] = await _together(replicas, "delete_note", title, 1)
        assert code(first) == "approval_pending"
        approval = await _approve(replicas, title)
        before = fake.calls["delete_note"]
        fake.delay = 0.3  # the first is still in flight while the others arrive
        try:
            results = await _together(replicas, "delete_note", title, 6)
        finally:
            fake.delay = 0.0
        assert fake.calls["delete_note"] == before + 1  # performed once: by the call that spent it
        performed = _performed_once(replicas, results)
        assert (performed["extra"]["approval_id"], performed["extra"]["approver"]) == (approval, "alice")


async def test_duplicates_held_for_one_approval_reach_the_upstream_once(replicas: Replicas) -> None:
    fake = replicas.fake
    fake.delay = 0.3
    try:
        held = asyncio.create_task(_together(replicas, "purge", "p1", 6))
        await _approve(replicas, "p1")  # the held calls wake at once (on the other replica: polled)
        results = await asyncio.wait_for(held, 15)
    finally:
        fake.delay = 0.0
    assert fake.calls["purge"] == 1
    _performed_once(replicas, results)


async def test_duplicates_outlasted_by_the_first_are_refused_in_flight(replicas: Replicas) -> None:
    fake = replicas.fake
    await _together(replicas, "delete_note", "d2", 1)
    await _approve(replicas, "d2")
    before = fake.calls["delete_note"]
    fake.delay = COUNTED_WAIT + 1.0  # the first outlasts the duplicates' wait
    try:
        results = await _together(replicas, "delete_note", "d2", 4)
    finally:
        fake.delay = 0.0
    assert fake.calls["delete_note"] == before + 1
    codes = sorted(map(code, results))
    assert codes == ["idempotency_in_flight"] * 3 + ["ok"], codes
    # Once it is done, the same call again is answered with its result, not performed again.
    [again] = await _together(replicas, "delete_note", "d2", 1)
    assert code(again) == "replayed"
    assert fake.calls["delete_note"] == before + 1
