"""Attacks on the state the workers share (`workers: 2`, the real proxy process, its SQLite
store): another principal's task ids, resumed streams and in-band answers, an answer replayed,
and a store that goes away while an answer is handed over. Each is refused on the wire.
"""

from __future__ import annotations

from pathlib import Path

from test_session_owners_e2e import MALLORY, _classified

CLOSE = {"Connection": "close"}  # every request on a new connection: either worker takes it
UNKNOWN_TASK = "unknown task: it was not created through this proxy by this principal (or is older than 24 h)"


def test_another_principals_task_is_neither_read_nor_cancelled_on_any_worker(tmp_path: Path) -> None:
    # The upstream knows one caller (the proxy) and keeps its tasks by id alone: on the old code
    # mallory's tasks/get (own session, or none) read alice's task status and tasks/cancel
    # cancelled her call; only tasks/result was refused.
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
        # Nothing of mallory's naming the task reached the upstream.
        assert [e["method"] for e in up.control.log(before) if e["method"].startswith("tasks/")] == []
        # Alice's own task is hers on either worker, and was not cancelled.
        for _ in range(4):
            status = alice.request("tasks/get", {"taskId": task_id}, CLOSE)
            assert status["result"]["taskId"] == task_id and status["result"]["status"] in ("working", "completed")
        result = alice.request("tasks/result", {"taskId": task_id}, CLOSE)
        assert "[REDACTED:classified]" in text_of(result), result
        assert [e["method"] for e in up.control.log(before)].count("tasks/cancel") == 0
