"""Attacks on the state the workers share (`workers: 2`, the real proxy process, its SQLite
store): another principal's task ids, resumed streams and in-band answers, an answer replayed,
and a store that goes away while an answer is handed over. Each is refused on the wire.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import write_doc
from test_inband_approval_e2e import Recorder
from test_session_owners_e2e import ACCEPT, LEGACY, MALLORY, _classified

from tests.harness import (
    ProxyProcess,
    metric_value,
    proxy_process,
    rpc,
    token,
    upstream_server,
    wait_port,
)

CLOSE = {"Connection": "close"}  # every request on a new connection: either worker takes it
UNKNOWN_TASK = "unknown task: it was not created through this proxy by this principal (or is older than 24 h)"


def test_another_principals_task_is_neither_read_nor_cancelled_on_any_worker(tmp_path: Path) -> None:
    # The upstream knows one caller (the proxy) and keeps its tasks by id alone: on the old code
    # mallory's tasks/get (own session, or none) read alice's task status, tasks/cancel
    # cancelled her call and tasks/list listed it; only tasks/result was refused.
    from test_response_path import Client, text_of

    with _classified(tmp_path) as (pp, up):
        alice = Client(pp.url("h"))
        created = alice.call("read_page", {"mode": "task", "text": "the code is CLASSIFIED-4471", "delay": 3},
                             task={"ttl": 60000})
        task_id = created["result"]["task"]["taskId"]
        before = len(up.control.log())
        for mallory in (Client(pp.url("h"), headers={"Authorization": f"Bearer {MALLORY}"}),
                        Client(pp.url("h"), stateless=True, headers={"Authorization": f"Bearer {MALLORY}"})):
            for method in ("tasks/get", "tasks/cancel", "tasks/result"):
                for _ in range(4):
                    reply = mallory.request(method, {"taskId": task_id}, CLOSE)
                    assert reply["error"]["code"] == -32602, (method, reply)
                    assert reply["error"]["message"].startswith(UNKNOWN_TASK), (method, reply)
                    assert "CLASSIFIED" not in text_of(reply) and "result" not in reply, (method, reply)
            for _ in range(4):  # the upstream lists every task it holds: alice's is not mallory's
                listed = mallory.request("tasks/list", {}, CLOSE)
                assert listed["result"]["tasks"] == [] and task_id not in text_of(listed), listed
        # Nothing of mallory's naming the task reached the upstream.
        assert [e["method"] for e in up.control.log(before)
                if e["method"].startswith("tasks/") and e["method"] != "tasks/list"] == []
        # Alice's own task is hers on either worker, and was not cancelled.
        for _ in range(4):
            assert [t["taskId"] for t in alice.request("tasks/list", {}, CLOSE)["result"]["tasks"]] == [task_id]
            status = alice.request("tasks/get", {"taskId": task_id}, CLOSE)
            assert status["result"]["taskId"] == task_id and status["result"]["status"] in ("working", "completed")
        result = alice.request("tasks/result", {"taskId": task_id}, CLOSE)
        assert "[REDACTED:classified]" in text_of(result), result
        assert [e["method"] for e in up.control.log(before)].count("tasks/cancel") == 0


def test_another_principal_cannot_resume_a_stream_on_any_worker(tmp_path: Path) -> None:
    # Alice's call leaves its stream resumable; mallory, holding her session id and the stream's
    # last event id, resumes it on a new connection (either worker): 404 as for a session that
    # does not exist, and the result stays alice's to resume.
    import json as _json

    from test_response_path import Client, sse, text_of

    with _classified(tmp_path) as (pp, _):
        alice = Client(pp.url("h"))
        response = alice.post({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
            "name": "read_page", "arguments": {"mode": "drop_resumable", "text": "alice's CLASSIFIED-7",
                                               "delay": 0.2}}}, CLOSE)
        last_id = [e["id"] for e in sse(response.text) if "id" in e][-1]
        for _ in range(8):
            stolen = httpx.get(alice.url, timeout=15, headers={
                **alice.headers(), "Authorization": f"Bearer {MALLORY}", "Accept": "text/event-stream",
                "Last-Event-ID": last_id, **CLOSE})
            assert stolen.status_code == 404, (stolen.status_code, stolen.text)
            assert stolen.json()["error"]["message"] == "Session not found"
            assert "alice" not in stolen.text and "CLASSIFIED" not in stolen.text
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="foreign_session") + \
            metric_value(httpx.get(f"http://127.0.0.1:{pp.admin_port + 1}/metrics", timeout=5).text,
                         "envelope_rejected_requests_total", reason="foreign_session") == 8
        resumed = alice.http.get(alice.url, headers={**alice.headers(), "Accept": "text/event-stream",
                                                     "Last-Event-ID": last_id, **CLOSE})
        answers = [_json.loads(e["data"]) for e in sse(resumed.text) if e.get("data")]
        result = next(m for m in answers if m.get("id") == 7)
        assert "alice's [REDACTED:classified]" in text_of(result), result


# -- in-band approval: the question on alice's call stream, answers on new connections ----------

ALICE = token("alice")
QUESTION_WAIT = "6s"


@contextlib.contextmanager
def _in_band(tmp_path: Path, config: dict[str, Any] | None = None) -> Iterator[tuple[ProxyProcess, Recorder]]:
    """Two workers in front of a recording pass-through (`rec`) to the demo notes server, whose
    `delete_note` is approved in-band."""
    doc = {"version": 1, "upstreams": {"rec": {"url": "http://127.0.0.1:1/mcp", "timeout": "20s"}},
           "defaults": {"unknown_tools": "deny"},
           "tools": {"rec.delete_note": {"effect": "destructive",
                                         "approval": {"required": True, "in_band": True, "wait": QUESTION_WAIT}},
                     "rec.write_note": {"effect": "write"}}}
    with upstream_server("sse") as up:
        recorder = Recorder(up.url)
        try:
            with proxy_process(tmp_path, {"rec": recorder.url}, policies=write_doc(tmp_path / "p", doc),
                               config={"workers": 2, **(config or {})}) as pp:
                wait_port(pp.admin_port + 1, pp.proc)
                yield pp, recorder
        finally:
            recorder.close()


def _headers(bearer: str, session: str | None) -> dict[str, str]:
    headers = {**ACCEPT, "Authorization": f"Bearer {bearer}", "MCP-Protocol-Version": LEGACY, **CLOSE}
    return {**headers, "Mcp-Session-Id": session} if session else headers


def _session(url: str, bearer: str) -> str:
    """A session whose client takes in-band questions (elicitation), initialized."""
    created = httpx.post(url, headers=_headers(bearer, None), timeout=15, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": LEGACY, "capabilities": {"elicitation": {}},
            "clientInfo": {"name": "t", "version": "1"}}})
    session = created.headers["Mcp-Session-Id"]
    httpx.post(url, headers=_headers(bearer, session), timeout=15,
               json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return session


def _messages(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON-RPC messages of an SSE response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip():
            yield json.loads(line[5:])


@contextlib.contextmanager
def _asking(url: str, session: str, title: str) -> Iterator[tuple[str, Iterator[dict[str, Any]]]]:
    """Alice's `delete_note` call, held: the id of the in-band question on its stream, and the
    stream's later messages (its result, id 1)."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "delete_note", "arguments": {"title": title}}}
    with httpx.stream("POST", url, json=body, headers=_headers(ALICE, session), timeout=30) as response:
        assert response.status_code == 200, response.read()
        messages = _messages(response)
        question = next(messages)
        assert question["method"] == "elicitation/create", question
        yield question["id"], messages


def _answer(url: str, bearer: str, session: str | None, request_id: str, approve: bool,
            reason: str) -> httpx.Response:
    return httpx.post(url, headers=_headers(bearer, session), timeout=15, json={
        "jsonrpc": "2.0", "id": request_id,
        "result": {"action": "accept", "content": {"approve": approve, "reason": reason}}})


def _result(messages: Iterator[dict[str, Any]]) -> dict[str, Any]:
    return next(m for m in messages if m.get("id") == 1)


def _audited(pp: ProxyProcess, tool: str) -> list[dict[str, Any]]:
    return [r for log in pp.worker_audit_records() for r in log if r["tool"] == tool]


def test_another_principals_answer_does_not_approve_a_call_on_any_worker(tmp_path: Path) -> None:
    # Mallory answers "approve" to alice's in-band question, on new connections (either worker:
    # the asker's, or the other one that hands answers over through the store), with alice's
    # session id, with her own session, and with none. None of it reaches alice's call: it waits
    # on, and alice's own answer decides.
    with _in_band(tmp_path) as (pp, rec):
        url = pp.url("rec")
        alice = _session(url, ALICE)
        mallory = _session(url, MALLORY)
        with _asking(url, alice, "alice-note") as (request_id, messages):
            for _ in range(6):
                stolen = _answer(url, MALLORY, alice, request_id, True, "mallory approves")
                assert stolen.status_code == 404 and stolen.json()["error"]["message"] == "Session not found"
                assert _answer(url, MALLORY, mallory, request_id, True, "mallory approves").status_code == 202
                assert _answer(url, MALLORY, None, request_id, True, "mallory approves").status_code == 202
            time.sleep(1.0)  # four of the asker's looks at the store
            assert [c for c in rec.calls() if c["params"]["name"] == "delete_note"] == []
            assert _answer(url, ALICE, alice, request_id, False, "alice says no").status_code == 202
            result = _result(messages)["result"]
        decision = result["_meta"]["envelope/decision"]
        assert result["isError"] is True and decision["code"] == "approval_denied", result
        assert "alice says no" in decision["reason"] and "mallory" not in json.dumps(result), decision
        assert [c for c in rec.calls() if c["params"]["name"] == "delete_note"] == []
        [record] = _audited(pp, "delete_note")
        assert record["verdict"] == "deny" and record["code"] == "approval_denied", record
        assert record["reason"].endswith("was denied by user:alice: alice says no"), record


def test_an_answer_sent_again_to_both_workers_performs_the_call_once(tmp_path: Path) -> None:
    # Alice's client sends its approving answer ten times on new connections: the asking worker
    # takes the first it sees (delivered to it, or handed over by the other worker); the rest,
    # and the same answer sent again after the call ended, change nothing.
    with _in_band(tmp_path) as (pp, rec):
        url = pp.url("rec")
        alice = _session(url, ALICE)
        with _asking(url, alice, "twice") as (request_id, messages):
            said = [_answer(url, ALICE, alice, request_id, True, "once").status_code for _ in range(10)]
            result = _result(messages)["result"]
        assert said == [202] * 10
        assert result.get("isError") is not True, result
        for _ in range(4):
            assert _answer(url, ALICE, alice, request_id, True, "once").status_code == 202
        time.sleep(1.0)
        assert len([c for c in rec.calls() if c["params"]["name"] == "delete_note"]) == 1
        [record] = _audited(pp, "delete_note")
        assert record["verdict"] == "allow" and record["extra"]["in_band"] is True, record



def test_an_answer_while_the_store_is_gone_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    # Redis dies while alice's question waits for its answer. Her answers, on new connections:
    # the asker (which knows the session) takes one or, the call having ended, cannot hand it
    # over; the other worker cannot read whose the session is. Each is a 202 or a 503 saying so;
    # the call is refused store_unavailable and audited, never performed.
    from tests.redis_server import running_redis

    (tmp_path / "redis").mkdir()
    with running_redis(tmp_path / "redis") as redis, _in_band(
            tmp_path, {"store": {"kind": "redis", "url": redis.url, "timeout": 1.0}}) as (pp, rec):
        url = pp.url("rec")
        alice = _session(url, ALICE)
        with _asking(url, alice, "store-gone") as (request_id, messages):
            redis.kill()
            said = [_answer(url, ALICE, alice, request_id, True, "yes") for _ in range(6)]
            result = _result(messages)["result"]
        for answer in said:
            assert answer.status_code in (202, 503), (answer.status_code, answer.text)
            if answer.status_code == 503:
                assert answer.json()["error"]["message"] in (
                    "the session's owner cannot be read (state store unavailable)",
                    "the answer could not be passed on (state store unavailable)"), answer.text
        decision = result["_meta"]["envelope/decision"]
        assert result["isError"] is True and decision["code"] == "store_unavailable", result
        assert result["content"][0]["text"].startswith("Blocked by policy (store_unavailable): the state store "
                                                       "(redis) is unavailable"), result
        time.sleep(0.5)
        assert [c for c in rec.calls() if c["params"]["name"] == "delete_note"] == []
        [record] = _audited(pp, "delete_note")
        assert (record["verdict"], record["code"], record["check"]) == ("error", "store_unavailable", "approval")


def _stateless(url: str, bearer: str, title: str, **params: Any) -> dict[str, Any]:
    """A 2026-07-28 `delete_note` call whose client takes elicitation (a new connection)."""
    body = {"jsonrpc": "2.0", "id": title, "method": "tools/call", "params": {
        "name": "delete_note", "arguments": {"title": title},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
                  "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}},
        **params}}
    response = rpc(url, body, bearer=bearer, headers={"Mcp-Method": "tools/call", "Mcp-Name": "delete_note", **CLOSE})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


def test_a_stateless_answer_is_taken_on_either_worker_and_only_once(tmp_path: Path) -> None:
    # The question's requestState is signed by the worker that asked; the retry carrying the
    # answer is a new request, on either worker. On the old code each worker signed with a
    # random secret of its own: a retry on the other worker was refused ("bad signature"), so
    # about half the approvals failed. Replayed (to both workers) or sent by another principal,
    # the answer is refused; each call is performed once.
    accept = {"envelope/approval": {"action": "accept", "content": {"approve": True}}}
    with _in_band(tmp_path) as (pp, rec):
        url = pp.url("rec")
        for i in range(6):
            title = f"stateless-{i}"
            asked = _stateless(url, ALICE, title)
            assert asked["resultType"] == "input_required", asked
            state = asked["requestState"]
            stolen = _stateless(url, MALLORY, title, inputResponses=accept, requestState=state)
            assert stolen["_meta"]["envelope/decision"]["code"] == "approval_denied", stolen
            answered = _stateless(url, ALICE, title, inputResponses=accept, requestState=state)
            assert answered.get("isError") is False, (i, answered)
            for _ in range(3):
                again = _stateless(url, ALICE, title, inputResponses=accept, requestState=state)
                assert again["_meta"]["envelope/decision"]["code"] == "approval_denied", again
                assert "could not be verified" in again["content"][0]["text"], again
        deletes = [c["params"]["arguments"]["title"] for c in rec.calls() if c["params"]["name"] == "delete_note"]
        assert deletes == [f"stateless-{i}" for i in range(6)]
        allowed = [r for r in _audited(pp, "delete_note") if r["verdict"] == "allow"]
        assert len(allowed) == 6 and all(r["extra"]["in_band"] is True for r in allowed), allowed


def _handed_over(pp: ProxyProcess) -> list[int]:
    """The sizes of the answers handed over between workers that the SQLite store holds."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{pp.state_dir / 'state.db'}?mode=ro", uri=True)) as db:
        return [n for (n,) in db.execute("SELECT length(value) FROM kv WHERE ns = 'elicitation-answers'")]


def test_answers_to_questions_never_asked_are_not_kept_for_the_workers(tmp_path: Path) -> None:
    # A worker that did not ask hands an answer over through the store, for the one that did.
    # On the old code it handed over any answer-shaped POST of a session, whole and for ten
    # minutes: a principal with a session of its own filled the store every worker shares
    # (4 MiB a request; here 8 x 512 KiB), with no question asked. Only an answer to a question
    # pending for that session and principal is handed over, and only what the asker reads of it.
    with _in_band(tmp_path) as (pp, rec):
        url = pp.url("rec")
        alice = _session(url, ALICE)
        for _ in range(8):
            unasked = _answer(url, ALICE, alice, f"envelope-{uuid.uuid4()}", True, "x" * 512 * 1024)
            assert unasked.status_code == 202, unasked.text
        assert _handed_over(pp) == []
        # An answer to a question pending on the other worker is still handed over, bounded.
        with _asking(url, alice, "bounded") as (request_id, messages):
            said = [_answer(url, ALICE, alice, request_id, True, "y" * 512 * 1024).status_code for _ in range(6)]
            result = _result(messages)["result"]
        assert said == [202] * 6 and result.get("isError") is not True, result
        assert all(size < 2048 for size in _handed_over(pp)), _handed_over(pp)
        assert len([c for c in rec.calls() if c["params"]["name"] == "delete_note"]) == 1
