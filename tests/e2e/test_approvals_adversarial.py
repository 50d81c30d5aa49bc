"""The approval gate under attack, through the wire: the real proxy process, the official SDK
client, the demo notes server (its `delete_note` answers `existed`, so a second deletion would
show) and the admin API.

Each test is an attack an adversarial review tried: what it proves is in its name. Those that
broke were fixed as a class: decisions were not audited (now an `<approval>` record before the
decision is stored, linked from the released call); the approver was shown arguments whose
invisible characters (bidi overrides, zero-width) hid what would run; and a message the proxy
and the upstream could read differently (a member named twice, a number read rounded) was
judged on one reading and forwarded as sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import cli, upstream_server, write_doc

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, rpc, token

OPS = token("ops", tenant="acme")
DEV = token("dev", tenant="acme")
ALICE_TOKEN = "alice-approver-token"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
# Approvers who may decide only some calls (`scope`); each one's token is "<name>-token".
SCOPED = {"carol": ["notes.delete_*"], "erin": ["notes.write_*", "other.*"], "dave": []}


def _policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "notes.delete_note": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
            # Held while it waits (a client may leave meanwhile).
            "notes.write_note": {"effect": "write", "approval": {"required": True, "wait": "20s"}},
            "notes.search_notes": {"effect": "read"},
        },
    })


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("approvals_adversarial")
    config = {"approvals": {"poll_interval": "100ms", "approvers": {
        "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()},
        **{name: {"token_sha256": hashlib.sha256(f"{name}-token".encode()).hexdigest(), "scope": scope}
           for name, scope in SCOPED.items()}}}}
    with upstream_server("sse") as up, proxy_process(
            tmp, {"notes": up.url}, policies=_policy(tmp / "policies"), config=config) as pp:
        yield pp


async def call(proxy: ProxyProcess, tool: str, args: dict[str, Any], bearer: str = OPS,
               run: str | None = None) -> Any:
    headers = {"X-Envelope-Run": run} if run is not None else None
    async with mcp_client(proxy.url("notes"), "auto", bearer=bearer, headers=headers) as c:
        return await c.call_tool(tool, args)


def meta(result: Any) -> dict[str, Any]:
    return dict((result.meta or {})["envelope/decision"])


async def admin(proxy: ProxyProcess, method: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.admin, timeout=10) as http:
        return await http.request(method, path, headers=ALICE, **kw)


async def pending(proxy: ProxyProcess, title: str) -> list[dict[str, Any]]:
    r = await admin(proxy, "GET", "/v1/approvals?state=pending")
    assert r.status_code == 200, r.text
    return [a for a in r.json()["approvals"] if a["arguments"].get("title") == title]


async def held(proxy: ProxyProcess, title: str, **kw: Any) -> dict[str, Any]:
    """Make the gated call, see it held, and return its (one) pending approval."""
    result = await call(proxy, "delete_note", {"title": title}, **kw)
    assert meta(result)["code"] == "approval_pending", meta(result)
    for _ in range(50):
        found = await pending(proxy, title)
        if found:
            return found[-1]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no pending approval for {title}")


async def approve(proxy: ProxyProcess, approval: dict[str, Any], reason: str = "ok") -> dict[str, Any]:
    r = await admin(proxy, "POST", f"/v1/approvals/{approval['id']}/approve", json={"reason": reason})
    assert r.status_code == 200, r.text
    return dict(r.json())


# -- binding: an approval releases its own call only (held) ------------------------------------


async def test_an_approval_releases_no_other_arguments_run_or_principal(proxy: ProxyProcess) -> None:
    approval = await held(proxy, "b1", run="run-b")
    await approve(proxy, approval)
    # Other arguments (an extra key, a number form, a look-alike), another run, another principal:
    # each is held for its own approval, none is released by this one.
    for args, kw in (({"title": "b1", "force": True}, {"run": "run-b"}),
                     ({"title": "b1\u200b"}, {"run": "run-b"}),
                     ({"title": "b1"}, {"run": "run-b-child"}),
                     ({"title": "b1"}, {"run": "run-b", "bearer": DEV})):
        result = await call(proxy, "delete_note", args, **kw)
        assert meta(result)["code"] in ("approval_pending", "schema_invalid"), (args, kw, meta(result))
        assert meta(result).get("decision_id") is not None
    performed = [r for r in proxy.audit_records()
                 if r["tool"] == "delete_note" and r["upstream_status"] == 200]
    assert performed == []
    # The call itself is released once, its retry replays.
    first = await call(proxy, "delete_note", {"title": "b1"}, run="run-b")
    again = await call(proxy, "delete_note", {"title": "b1"}, run="run-b")
    assert first.is_error is False and again.structured_content == first.structured_content


# -- audit: every decision has its record, and the released call links to it (broke) ----------


async def test_every_decision_is_audited_and_the_released_call_names_it(proxy: ProxyProcess) -> None:
    approved = await held(proxy, "a1", run="run-a")
    denied = await held(proxy, "a2", run="run-a")
    decided = await approve(proxy, approved, "ticket 42")
    r = await admin(proxy, "POST", f"/v1/approvals/{denied['id']}/deny", json={"reason": "not this"})
    assert r.status_code == 200, r.text

    records = {r["decision_id"]: r for r in proxy.audit_records()}
    yes = records[decided["decision_record"]]
    assert (yes["method"], yes["check"], yes["verdict"], yes["principal"], yes["run"], yes["tool"]) == (
        "<approval>", "approval", "allow", "ops", "run-a", "<approval>")
    assert yes["args_digest"] == approved["args_digest"]
    assert yes["extra"] == {"approver": "alice", "tool": "delete_note", "approval_id": approved["id"],
                            "decision": "approved"}
    assert "ticket 42" in yes["reason"]
    no = [rec for rec in records.values()
          if rec.get("method") == "<approval>" and rec["extra"]["approval_id"] == denied["id"]]
    assert len(no) == 1 and no[0]["verdict"] == "deny" and no[0]["extra"]["decision"] == "denied"

    released = await call(proxy, "delete_note", {"title": "a1"}, run="run-a")
    assert released.is_error is False
    rec = [r for r in proxy.audit_records()
           if r["tool"] == "delete_note" and r["upstream_status"] == 200 and r["run"] == "run-a"]
    assert len(rec) == 1
    assert rec[0]["extra"]["approval_id"] == approved["id"]
    assert rec[0]["extra"]["approval_record"] == yes["decision_id"]

    # A decision that cannot be made (no longer pending) is audited as refused, naming the request.
    r = await admin(proxy, "POST", f"/v1/approvals/{denied['id']}/approve", json={"reason": "changed my mind"})
    assert r.status_code == 409
    late = [rec for rec in proxy.audit_records()
            if rec.get("method") == "<approval>" and rec["extra"]["approval_id"] == denied["id"]]
    assert [(x["verdict"], x["extra"]["decision"], x["extra"].get("refused")) for x in late] == [
        ("deny", "denied", None), ("deny", "approved", True)]


# -- an approver decides only within their scope (was: any approver decided any call) ----------


async def test_an_approver_decides_only_the_calls_their_scope_names(proxy: ProxyProcess) -> None:
    approval = await held(proxy, "s1", run="run-s")

    async def decide(name: str, verb: str = "approve") -> httpx.Response:
        async with httpx.AsyncClient(base_url=proxy.admin, timeout=10) as http:
            return await http.post(f"/v1/approvals/{approval['id']}/{verb}", json={"reason": "mine"},
                                   headers={"Authorization": f"Bearer {name}-token"})

    for name in ("erin", "dave"):  # other tools' approver; a reviewer who decides nothing
        for verb in ("approve", "deny"):
            r = await decide(name, verb)
            assert r.status_code == 403 and "may not decide calls of notes.delete_note" in r.json()["error"], r.text
    refused = [rec for rec in proxy.audit_records()
               if rec.get("method") == "<approval>" and rec["extra"]["approval_id"] == approval["id"]]
    assert sorted(x["extra"]["approver"] for x in refused) == ["dave", "dave", "erin", "erin"]
    assert all(x["verdict"] == "deny" and x["extra"]["refused"] for x in refused)
    assert (await pending(proxy, "s1"))[0]["id"] == approval["id"]  # still waiting
    r = await decide("carol")  # `notes.delete_*` covers it
    assert r.status_code == 200 and r.json()["approver"] == "carol"
    released = await call(proxy, "delete_note", {"title": "s1"}, run="run-s")
    assert released.is_error is False

    # A run's intent endorses values for every tool of the run: no scoped approver sets one.
    async with httpx.AsyncClient(base_url=proxy.admin, timeout=10) as http:
        body = {"principal": "ops", "text": "delete s2"}
        r = await http.post("/v1/runs/run-s/intent", json=body, headers={"Authorization": "Bearer carol-token"})
        assert r.status_code == 403 and "only an approver without a scope" in r.json()["error"]
        r = await http.post("/v1/runs/run-s/intent", json=body, headers=ALICE)
        assert r.status_code == 200, r.text


# -- what the approver reads is what runs (broke: hidden characters were shown raw) ------------


async def test_the_approver_reads_hidden_characters_escaped_and_is_warned(proxy: ProxyProcess) -> None:
    # "report\u202efdp.exe" shows as "reportexe.pdf" where bidi is honoured; a zero-width space
    # makes "a1" and "a\u200b1" look the same.
    title = "report\u202efdp.exe"
    approval = await held(proxy, title, run="run-h")
    assert approval["arguments"] == {"title": title}  # the exact arguments stay in the record
    text = approval["arguments_text"]
    assert "\u202e" not in text and '"report\\u202efdp.exe"' in text
    assert json.loads(text) == approval["arguments"]
    assert approval["hidden_characters"] == [{"path": "/title", "characters": ["U+202E"]}]
    plain = await held(proxy, "plain title", run="run-h")
    assert plain["hidden_characters"] == [] and '"plain title"' in plain["arguments_text"]
    # The page's script shows `arguments_text` and the warning, never the raw arguments.
    async with httpx.AsyncClient(base_url=proxy.admin, timeout=10) as http:
        script = (await http.get("/review/static/review.js")).text
    assert "a.arguments_text" in script and "hidden_characters" in script


async def test_the_approver_sees_a_look_alike_letter_escaped_and_is_warned(proxy: ProxyProcess) -> None:
    # "invoice-p\u0430ypal" (a Cyrillic "a", U+0430) reads as the Latin name on any screen.
    title = "invoice-p\u0430ypal"
    approval = await held(proxy, title, run="run-l")
    assert approval["arguments"] == {"title": title}
    assert '"invoice-p\\u0430ypal"' in approval["arguments_text"]
    assert json.loads(approval["arguments_text"]) == approval["arguments"]
    assert approval["hidden_characters"] == [{"path": "/title", "characters": ["U+0430"]}]
    honest = await held(proxy, "Счёт за март", run="run-l")  # one script: shown as written
    assert honest["hidden_characters"] == [] and "Счёт за март" in honest["arguments_text"]
    # What no hidden category and no look-alike script held (was shown raw): a variation
    # selector, which a screen shows as nothing, and a mathematical "p" (U+1D5C9) among Latin ones.
    for title, escaped, code in (("invoice-paypal\ufe0f", "invoice-paypal\\ufe0f", "U+FE0F"),
                                 ("invoice-\U0001d5c9aypal", "invoice-\\ud835\\uddc9aypal", "U+1D5C9")):
        approval = await held(proxy, title, run="run-l")
        assert f'"{escaped}"' in approval["arguments_text"], approval["arguments_text"]
        assert approval["hidden_characters"] == [{"path": "/title", "characters": [code]}]


# -- the envelope and the upstream read the same message (broke: duplicate names, big numbers) -


@pytest.mark.parametrize("raw", [
    # The proxy read the last "method" (ping: relayed byte for byte, no envelope, no approval);
    # an upstream reading the first would delete the note.
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"delete_note",'
    b'"arguments":{"title":"welcome"}},"method":"ping"}',
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"delete_note",'
    b'"arguments":{"title":"welcome"}},"\\u006dethod":"ping"}',
    # The approver would see (and approve) "harmless"; an upstream reading the first deletes
    # "welcome".
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"delete_note",'
    b'"arguments":{"title":"welcome","title":"harmless"}}}',
    # Read rounded, two different numbers share one digest: approving one would release the
    # other, which a big-number upstream reads as it was sent.
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"delete_note",'
    b'"arguments":{"title":"welcome","version":18446744073709551617}}}',
    b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"delete_note",'
    b'"arguments":{"title":"welcome","version":1.00000000000000000001}}}',
])
def test_a_message_the_upstream_could_read_otherwise_is_refused_not_relayed(
        proxy: ProxyProcess, raw: bytes) -> None:
    before = len(proxy.audit_records())
    resp = rpc(proxy.url("notes"), None, bearer=OPS, raw=raw)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == -32600
    assert "the proxy and the upstream could read different values" in error["message"]
    assert len(proxy.audit_records()) == before  # refused at the front: no call, no approval


# -- the approver's terminal obeys nothing a caller wrote (broke: escape sequences) ------------


def test_a_callers_escape_sequences_never_reach_the_approvers_terminal(proxy: ProxyProcess) -> None:
    # A stateless call without X-Envelope-Run is in the run its client names: the client's name
    # comes from the request body, so it can hold anything (here: a window-title and a
    # clear-screen sequence, and a right-to-left override).
    name = "agent\x1b]0;approved\x07\x1b[2J\u202ekcatta"
    body = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
        "name": "delete_note", "arguments": {"title": "esc-1"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientInfo": {"name": name, "version": "1"}}}}
    resp = rpc(proxy.url("notes"), body, bearer=OPS,
               headers={"Mcp-Method": "tools/call", "Mcp-Name": "delete_note"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["result"]["_meta"]["envelope/decision"]["code"] == "approval_pending"
    env = {**os.environ, "ENVELOPE_APPROVER_TOKEN": ALICE_TOKEN}
    listed = cli("approvals", "--admin", proxy.admin, "list", env=env)
    assert listed.returncode == 0, listed.stderr
    line = [x for x in listed.stdout.splitlines() if "kcatta" in x]
    assert len(line) == 1
    assert "\x1b" not in listed.stdout and "\x07" not in listed.stdout and "\u202e" not in listed.stdout
    assert "agent\\u001b]0;approved\\u0007\\u001b[2J\\u202ekcatta@1" in line[0]
    table = cli("audit", "query", str(proxy.audit_dir), "--tool", "delete_note")
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\u202e" not in table.stdout


# -- a call whose client left while it was held (broke: no record, the approval named nothing) -


async def test_a_call_whose_client_left_while_held_is_audited_and_runs_only_when_retried(
        proxy: ProxyProcess) -> None:
    # The agent asks, the call is held for a person, the agent goes away. The approval (and its
    # webhook) name the call's decision id; on main the audit log had no record of that call at
    # all, so an approver or auditor following the id found nothing.
    body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "write_note", "arguments": {"title": "gone-1", "body": "b"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {"Authorization": f"Bearer {OPS}", "X-Envelope-Run": "run-gone",
               "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
               "Mcp-Method": "tools/call", "Mcp-Name": "write_note"}
    async with httpx.AsyncClient(timeout=30) as http:
        asking = asyncio.create_task(http.post(proxy.url("notes"), json=body, headers=headers))
        approval: dict[str, Any] | None = None
        for _ in range(100):
            found = await pending(proxy, "gone-1")
            if found:
                approval = found[0]
                break
            await asyncio.sleep(0.05)
        assert approval is not None and not asking.done()
        asking.cancel()  # the client closes its connection while the call is held
        with contextlib.suppress(asyncio.CancelledError):
            await asking

    def records() -> list[dict[str, Any]]:
        return [r for r in proxy.audit_records() if r["decision_id"] == approval["decision_id"]]

    for _ in range(100):
        if records():
            break
        await asyncio.sleep(0.05)
    [gone] = records()
    assert (gone["tool"], gone["run"], gone["verdict"], gone["code"], gone["upstream_status"]) == (
        "write_note", "run-gone", "error", "client_disconnected", None)
    assert gone["extra"]["approval_id"] == approval["id"]
    assert gone["extra"]["client_disconnected"] is True
    # Approving it performs nothing (nobody is waiting for it); the agent's retry performs it
    # once, and a second retry is answered from the first.
    await approve(proxy, approval)
    await asyncio.sleep(0.5)
    assert [r for r in proxy.audit_records() if r["run"] == "run-gone" and r["upstream_status"]] == []
    first = await call(proxy, "write_note", {"title": "gone-1", "body": "b"}, run="run-gone")
    again = await call(proxy, "write_note", {"title": "gone-1", "body": "b"}, run="run-gone")
    assert first.is_error is False and meta(again)["code"] == "replayed"
    performed = [r for r in proxy.audit_records() if r["run"] == "run-gone" and r["upstream_status"] == 200]
    assert len(performed) == 1 and performed[0]["extra"]["approval_id"] == approval["id"]


# -- an approved call the upstream never performed (broke: refused for the approval's lifetime) -


def test_an_approved_call_the_upstream_failed_asks_anew_when_called_again(tmp_path: Path) -> None:
    # The upstream is down: the approved call is spent on a failure that performed nothing. The
    # retry is refused (the approval is used; no result to replay), saying to ask again; on main
    # every later call was refused the same way until the approval record expired (ttl plus
    # 24 h retention), with nothing that could ask again.
    body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
        "name": "delete_note", "arguments": {"title": "down-1"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {"Mcp-Method": "tools/call", "Mcp-Name": "delete_note", "X-Envelope-Run": "run-down"}

    def decided() -> dict[str, Any]:
        resp = rpc(pp.url("notes"), body, bearer=OPS, headers=headers)
        assert resp.status_code == 200, resp.text
        return dict(resp.json()["result"]["_meta"]["envelope/decision"])

    with _guessed_at(tmp_path) as pp:
        first = decided()
        assert first["code"] == "approval_pending"
        approval_id = first["reason"].split()[1]
        r = httpx.post(f"{pp.admin}/v1/approvals/{approval_id}/approve", json={"reason": "ok"},
                       headers=ALICE, timeout=10)
        assert r.status_code == 200, r.text
        assert decided()["code"] == "upstream_error"
        spent = decided()
        assert spent["code"] == "approval_expired" and "calling again asks" in spent["reason"], spent
        again = decided()
        assert again["code"] == "approval_pending", again
        assert approval_id not in again["reason"]  # a new approval, for a person to decide
        r = httpx.get(f"{pp.admin}/v1/approvals", params={"state": "pending"}, headers=ALICE, timeout=10)
        assert [a["args_digest"] for a in r.json()["approvals"]] == [
            next(x for x in pp.audit_records() if x["decision_id"] == again["decision_id"])["args_digest"]]
        records = [x for x in pp.audit_records() if x["run"] == "run-down" and x["tool"] == "delete_note"]
        assert [x["code"] for x in records] == [
            "approval_pending", "upstream_error", "approval_expired", "approval_pending"]


# What a caller can put into text a reviewer reads in a terminal: a window title (OSC 0), a
# clear-screen (CSI 2J), a right-to-left override and the 8-bit CSI (U+009B).
ESCAPES = "x\x1b]0;approved\x07\x1b[2J\u202ekcatta\x9b31m"


def _raw_controls(text: str) -> list[str]:
    return sorted({f"U+{ord(c):04X}" for c in text if c in "\x1b\x07\u202e\x9b"})


def test_shadow_records_replay_and_json_records_reach_the_terminal_escaped(tmp_path: Path) -> None:
    # `approvals list` and the `audit query` table escaped such text already; `shadow list`,
    # `replay`'s report and `audit query|tail --format json` passed it raw (broke).
    policy = write_doc(tmp_path / "policies", {
        "version": 1, "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp"}},
        "defaults": {"unknown_tools": "deny", "log_args": True},
        "tools": {"notes.write_note": {"effect": "write", "mode": "shadow"},
                  "notes.search_notes": {"effect": "read"}}})
    calls = tmp_path / "calls.jsonl"
    # A `sub` holding them is refused 401 (`test_identity_names_e2e`): the arguments and the
    # client's name carry them here.
    evil = token("ops", tenant="acme")
    env = {**os.environ, "ENVELOPE_APPROVER_TOKEN": ALICE_TOKEN}
    config = {"approvals": {"approvers": {
        "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}}}}
    with upstream_server("sse") as up, proxy_process(
            tmp_path, {"notes": up.url}, policies=policy, config=config,
            args=["--record", str(calls)]) as pp:
        for tool, args in (("write_note", {"title": "t" + ESCAPES, "body": "b"}),
                           ("search_notes", {"query": "q"})):
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
                "name": tool, "arguments": args,
                "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                          "io.modelcontextprotocol/clientCapabilities": {},
                          "io.modelcontextprotocol/clientInfo": {"name": "agent" + ESCAPES,
                                                                 "version": "1"}}}}
            resp = rpc(pp.url("notes"), body, bearer=evil,
                       headers={"Mcp-Method": "tools/call", "Mcp-Name": tool})
            assert resp.status_code == 200 and "result" in resp.json(), resp.text
        shown = {"shadow list": cli("shadow", "list", "--admin", pp.admin, env=env),
                 "audit query --format json": cli("audit", "query", str(pp.audit_dir), "--format", "json"),
                 "audit tail --format json": cli("audit", "tail", str(pp.audit_dir), "--format", "json")}
    # The replay names each call's principal: one a version before principals were held to
    # `proxy.identity.name_problem` recorded (or a hand-edited file) may hold them.
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    for rec in recorded:
        rec["principal"]["id"] = "ops" + ESCAPES
    calls.write_text("".join(json.dumps(rec) + "\n" for rec in recorded))
    # A candidate policy that no longer knows search_notes: the replay names the call.
    write_doc(tmp_path / "candidate", {
        "version": 1, "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp"}},
        "defaults": {"unknown_tools": "deny"}, "tools": {"notes.write_note": {"effect": "write"}}})
    shown["replay"] = cli("replay", "--policies", str(tmp_path / "candidate"), str(calls))
    for what, done in shown.items():
        assert done.returncode == 0, (what, done.stderr)
        assert "kcatta" in done.stdout, (what, done.stdout)
        assert _raw_controls(done.stdout) == [], (what, done.stdout)
    assert "\\u001b]0;approved\\u0007\\u001b[2J\\u202ekcatta\\u009b31m" in shown["shadow list"].stdout
    assert "principal=opsx\\u001b]0;approved" in shown["replay"].stdout
    # JSON stays JSON and says the same: the characters are escaped, not dropped.
    lines = [json.loads(line) for line in shown["audit query --format json"].stdout.splitlines()]
    assert {rec["run"] for rec in lines} == {f"principal:ops/client:agent{ESCAPES}@1"}


# -- the admin listener against a browser and a guesser (held) ---------------------------------


async def test_no_cross_site_request_framing_or_token_guess_decides_an_approval(proxy: ProxyProcess) -> None:
    approval = await held(proxy, "csrf-1", run="run-c")
    path = f"/v1/approvals/{approval['id']}/approve"
    async with httpx.AsyncClient(base_url=proxy.admin, timeout=10) as http:
        # What a page elsewhere can make a browser send: a simple form POST (no Authorization),
        # a preflight, a rebound name; and a token one character off.
        form = await http.post(path, content=b'{"reason":"x"}', headers={
            "Origin": "https://evil.example", "Content-Type": "text/plain"})
        assert form.status_code == 401
        preflight = await http.request("OPTIONS", path, headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert "access-control-allow-origin" not in preflight.headers
        rebound = await http.post(path, json={"reason": "x"},
                                  headers={**ALICE, "Host": "evil.example"})
        assert rebound.status_code == 421
        near = await http.post(path, json={"reason": "x"},
                               headers={"Authorization": f"Bearer {ALICE_TOKEN[:-1]}X"})
        assert near.status_code == 401
        page = await http.get("/review")
        assert page.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert (await admin(proxy, "GET", f"/v1/approvals/{approval['id']}")).json()["state"] == "pending"


# -- the decision's body on the wire (held) ----------------------------------------------------


async def _raw_admin_post(proxy: ProxyProcess, path: str, pieces: list[bytes],
                          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """POST `pieces` as one body to the admin listener, each piece in its own write with a pause
    between (as a slow or chunking client sends it); the status and the JSON answer."""
    host, port = proxy.admin.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body_length = sum(map(len, pieces))
    head = "".join(f"{k}: {v}\r\n" for k, v in {**ALICE, "Content-Type": "application/json",
                                                  **(headers or {})}.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: {body_length}\r\n"
                 "Connection: close\r\n\r\n".encode())
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.2)
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


async def test_a_decision_whose_body_arrives_in_pieces_is_read_whole(proxy: ProxyProcess) -> None:
    approval = await held(proxy, "slow-body-1", run="run-slow")
    status, answer = await _raw_admin_post(
        proxy, f"/v1/approvals/{approval['id']}/deny", [b'{"reas', b'on": "sent in two pieces"}'])
    assert status == 200, answer
    assert (answer["state"], answer["decision_reason"]) == ("denied", "sent in two pieces")


async def test_a_body_that_cannot_be_decoded_is_refused_as_such_not_a_server_error(
        proxy: ProxyProcess) -> None:
    approval = await held(proxy, "bad-gzip-1", run="run-gzip")
    status, answer = await _raw_admin_post(proxy, f"/v1/approvals/{approval['id']}/approve",
                                           [b"not gzip at all"], {"Content-Encoding": "gzip"})
    assert status == 400
    assert answer["error"] == "the body cannot be read: Can not decode content-encoding: gzip", answer
    assert "Unhandled exception" not in proxy.log()
    assert (await admin(proxy, "GET", f"/v1/approvals/{approval['id']}")).json()["state"] == "pending"


def test_the_admin_listeners_refusals_are_counted(proxy: ProxyProcess) -> None:
    # A token being guessed or a rebound name must show somewhere: neither is audited (no call),
    # so each is counted; on main nothing counted them.
    name = "envelope_admin_rejected_requests_total"

    def counts() -> tuple[float, float]:
        text = proxy.metrics()
        return (metric_value(text, name, reason="bad_host"),
                metric_value(text, name, reason="unauthenticated"))

    hosts, tokens = counts()
    assert httpx.get(f"{proxy.admin}/healthz", headers={"Host": "evil.example"}).status_code == 421
    for headers in ({}, {"Authorization": f"Bearer {ALICE_TOKEN}x"}):
        for path in ("/v1/approvals", "/v1/decisions", "/v1/policy"):
            assert httpx.get(f"{proxy.admin}{path}", headers=headers).status_code == 401, path
    assert httpx.post(f"{proxy.admin}/v1/runs/r/intent", json={}).status_code == 401
    assert counts() == (hosts + 1, tokens + 7)


async def test_a_decision_body_past_the_limit_is_refused_413_and_decides_nothing(
        proxy: ProxyProcess) -> None:
    # 64 KiB is the approvals API's bound (`protect.read_body`): counted across the pieces a
    # body arrives in, not in the first read only.
    approval = await held(proxy, "big-body-1", run="run-big")
    reason = b"x" * (80 * 1024)
    body = b'{"reason": "' + reason + b'"}'
    status, answer = await _raw_admin_post(proxy, f"/v1/approvals/{approval['id']}/deny",
                                           [body[: len(body) // 2], body[len(body) // 2:]])
    assert status == 413, answer
    assert answer["error"] == f"body larger than {64 * 1024} bytes", answer
    assert (await admin(proxy, "GET", f"/v1/approvals/{approval['id']}")).json()["state"] == "pending"


@contextlib.contextmanager
def _guessed_at(tmp: Path) -> Iterator[ProxyProcess]:
    """A proxy whose one approver (alice) a client guesses tokens against."""
    config = {"approvals": {"approvers": {
        "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}}}}
    with proxy_process(tmp, {"notes": "http://127.0.0.1:1/mcp"}, policies=_policy(tmp / "policies"),
                       config=config) as pp:
        yield pp


def _failed_after_shutdown(pp: ProxyProcess, at_once: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failed-authentication records once the proxy has stopped: the one written at once
    (`at_once`, read while it served) first, then what was held; the chain verifies."""
    failed = [r for r in pp.audit_records() if r["code"] == "unauthorized"]
    assert at_once == failed[:1]
    done = cli("audit", "verify", str(pp.audit_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    return failed


def test_failed_approver_authentication_on_decisions_is_audited_at_most_twice_a_window(
        tmp_path: Path) -> None:
    # A token guessed against approve and deny was counted, never audited. Now the first failure
    # is on record at once and the flood after it as one aggregated record (here written at
    # shutdown, before the audit log closes): 30 attempts, two records, a chain that verifies.
    with _guessed_at(tmp_path) as pp:
        for i in range(30):
            headers = {"Authorization": f"Bearer guess-{i}"} if i % 3 else {}
            verb = "approve" if i % 2 else "deny"
            reply = httpx.post(f"{pp.admin}/v1/approvals/apr-{i % 4:016x}/{verb}", json={"reason": "x"},
                               headers=headers, timeout=10)
            assert reply.status_code == 401, reply.text
        assert metric_value(pp.metrics(), "envelope_admin_rejected_requests_total",
                            reason="unauthenticated") == 30
        at_once = [r for r in pp.audit_records() if r["code"] == "unauthorized"]
    failed = _failed_after_shutdown(pp, at_once)
    first, held = failed
    assert all((r["tool"], r["method"], r["check"], r["verdict"], r["principal"])
               == ("<approval>", "<approval>", "approval", "deny", "<unverified>") for r in failed)
    assert (first["extra"]["approval_id"], first["extra"]["decision"], first["extra"]["token"],
            first["extra"]["failures"]) == ("apr-0000000000000000", "deny", "missing", 1)
    assert held["extra"]["failures"] == 29
    assert held["extra"]["tokens"] == {"missing": 9, "unknown": 20}
    assert held["extra"]["approval_ids"] == [f"apr-{i:016x}" for i in range(4)]
    assert held["extra"]["remotes"] == ["127.0.0.1"]
    assert "guess-" not in str(failed)  # a guessed token is never written down


def test_a_failed_intent_authentication_names_only_a_valid_run(tmp_path: Path) -> None:
    """The 401 comes before the run is checked, but its record names the run only when it is a
    run id (1-256 printable ASCII), as the guard's refusals of X-Envelope-Run do: a bidi
    override and a line break sent by an unauthenticated client never reach the audit log."""
    with _guessed_at(tmp_path) as pp:
        for run in ("%E2%80%AEevil%0Arun", "ok-run"):
            reply = httpx.post(f"{pp.admin}/v1/runs/{run}/intent",
                               json={"principal": "agent", "text": "send it"}, timeout=10)
            assert reply.status_code == 401, reply.text
        at_once = [r for r in pp.audit_records() if r["code"] == "unauthorized"]
    first, held = _failed_after_shutdown(pp, at_once)
    assert first["extra"]["run"] == "<invalid run id>", first
    assert first["reason"] == ("approver authentication failed (missing token): intent for run "
                               "'<invalid run id>' not set")
    assert held["extra"]["runs"] == ["ok-run"]
    assert "\u202e" not in json.dumps([first, held]).lower()
    assert "evil" not in json.dumps([first, held])


def test_a_failed_decision_authentication_names_only_a_valid_approval_id(tmp_path: Path) -> None:
    """As for a run: the record named the id as the unauthenticated client sent it, so a bidi
    override and a line break reached the audit log (and the review page reading it). Now an id
    not of the shape approval ids have (`apr-` and 16 hex digits) is named by a marker."""
    valid = "apr-0123456789abcdef"
    with _guessed_at(tmp_path) as pp:
        for sent in ("%E2%80%AEevil%0Aapr-0123456789abcdef", valid, "APR-0123456789ABCDEF"):
            reply = httpx.post(f"{pp.admin}/v1/approvals/{sent}/approve", json={"reason": "x"},
                               timeout=10)
            assert reply.status_code == 401, reply.text
        at_once = [r for r in pp.audit_records() if r["code"] == "unauthorized"]
    first, held = _failed_after_shutdown(pp, at_once)
    assert first["extra"]["approval_id"] == "<invalid approval id>", first
    assert first["reason"] == ("approver authentication failed (missing token): approval "
                               "'<invalid approval id>' not approved")
    assert held["extra"]["approval_ids"] == ["<invalid approval id>", valid]
    text = json.dumps([first, held])  # a bidi override would be written `\\u202e` here
    assert "\\u202e" not in text and "evil" not in text and "ABCDEF" not in text


def test_failed_approver_authentication_on_intents_is_audited_with_the_decisions_at_most_twice_a_window(
        tmp_path: Path) -> None:
    # A 401 on `POST /v1/runs/<run>/intent` was counted, never audited. Now it goes through the
    # decisions' limiter: the first failure on record at once, the rest of the window (intents
    # and a deny alike) as one aggregated record at shutdown.
    with _guessed_at(tmp_path) as pp:
        for i in range(20):
            headers = {"Authorization": f"Bearer guess-{i}"} if i % 2 else {}
            reply = httpx.post(f"{pp.admin}/v1/runs/run-{i % 3}/intent",
                               json={"principal": "agent", "text": "send it"}, headers=headers,
                               timeout=10)
            assert reply.status_code == 401, reply.text
        reply = httpx.post(f"{pp.admin}/v1/approvals/apr-0000000000000009/deny", json={"reason": "x"}, timeout=10)
        assert reply.status_code == 401, reply.text
        assert metric_value(pp.metrics(), "envelope_admin_rejected_requests_total",
                            reason="unauthenticated") == 21
        at_once = [r for r in pp.audit_records() if r["code"] == "unauthorized"]
    failed = _failed_after_shutdown(pp, at_once)
    first, held = failed
    assert all((r["tool"], r["check"], r["verdict"], r["principal"])
               == ("<approval>", "approval", "deny", "<unverified>") for r in failed)
    assert (first["extra"]["run"], first["extra"]["action"], first["extra"]["token"],
            first["extra"]["failures"]) == ("run-0", "intent", "missing", 1)
    assert first["reason"] == "approver authentication failed (missing token): intent for run 'run-0' not set"
    assert held["extra"]["failures"] == 20
    assert held["extra"]["tokens"] == {"missing": 10, "unknown": 10}
    assert held["extra"]["runs"] == ["run-0", "run-1", "run-2"]
    assert held["extra"]["approval_ids"] == ["apr-0000000000000009"]
    assert "guess-" not in str(failed) and "send it" not in str(failed)
