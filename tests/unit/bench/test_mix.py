"""The realistic-mix bench's pieces (bench/mix.py, bench/mix_upstream.py), without running a bench.

What a wrong piece would do: an upstream that sends the same output every call (the ledger would
dedupe it and the bench would flatter the envelope), an output of the wrong size, a session
client without the session id, a report that inverts the per-CPU ratio, a results file whose
other sections are lost when the mix section is rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import mix  # noqa: E402
import mix_upstream  # noqa: E402
import run as R  # noqa: E402

from proxy.policy.loader import load_policy  # noqa: E402


def _http(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


def test_tools_call_output_has_the_size_asked_and_changes_every_call() -> None:
    answers = mix_upstream.Answers(5000)
    body = mix.call_body("stateless").encode()
    first, second = (json.loads(_http(answers.reply(body))[1]) for _ in range(2))
    texts = [r["result"]["content"][0]["text"] for r in (first, second)]
    assert [len(t) for t in texts] == [5000, 5000]
    assert texts[0] != texts[1]
    assert first["id"] == 1 and first["result"]["isError"] is False


def test_no_output_comes_back_within_a_long_cell() -> None:
    """An output sent again within seconds costs the envelope no store write (it was recorded):
    a bench whose upstream repeats itself flatters the envelope. 20,000 calls (a 10 s cell at
    2,000 req/s) must all differ."""
    answers = mix_upstream.Answers(200)
    outputs = {answers.call_result() for _ in range(20_000)}
    assert len(outputs) == 20_000


def test_initialize_answers_a_session_id_and_the_client_version() -> None:
    answers = mix_upstream.Answers(200)
    init = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                       "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}).encode()
    head, body = _http(answers.reply(init))
    assert b"Mcp-Session-Id: " + mix_upstream.SESSION_ID in head
    assert json.loads(body)["result"]["protocolVersion"] == "2025-11-25"
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
    assert answers.reply(note).startswith(b"HTTP/1.1 202 ")


def test_stateless_and_session_calls_carry_their_revision() -> None:
    stateless = json.loads(mix.call_body("stateless"))
    assert stateless["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] == mix.STATELESS
    assert mix.base_headers("stateless")["Mcp-Method"] == "tools/call"
    session = json.loads(mix.call_body("session"))
    assert "_meta" not in session["params"]
    assert mix.base_headers("session")["MCP-Protocol-Version"] == mix.SESSION


def test_decode_reads_json_and_the_last_sse_event() -> None:
    assert mix.decode(b'{"id": 1}') == {"id": 1}
    assert mix.decode(b'event: message\ndata: {"id": 1}\n\ndata: {"id": 2}\n\n') == {"id": 2}
    with pytest.raises(ValueError):
        mix.decode(b"event: ping\n\n")


def test_write_section_replaces_only_the_mix_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\nbefore\n")
    mix.write_section(results, f"{mix.BEGIN}\nfirst\n{mix.END}\n")
    mix.write_section(results, f"{mix.BEGIN}\nsecond\n{mix.END}\n")
    results.write_text(results.read_text() + "\nafter\n")
    mix.write_section(results, f"{mix.BEGIN}\nthird\n{mix.END}\n")
    text = results.read_text()
    assert text.startswith("# results\n\nbefore\n")
    assert "third" in text and "first" not in text and "second" not in text
    assert text.rstrip().endswith("after")


def test_report_states_the_per_cpu_ratio_against_fastmcp() -> None:
    args = argparse.Namespace(sizes=[200], clients=["stateless"], configs=list(mix.CONFIGS), workers=[1],
                              concurrency=[32], duration=2.0, warmup=0.5, ledger_cap=None)

    def cell(config: str, cpu: float | None, rps: float, p50: float) -> mix.Cell:
        return mix.Cell(200, "stateless", config, 1, 32, rps, p50, 2 * p50, 1000, cpu, 100.0)

    cells = [cell("direct", None, 10000, 1.0), cell("passthrough", 400.0, 2000, 10.0),
             cell("envelope", 100.0, 3000, 8.0), cell("fastmcp", 2500.0, 300, 90.0)]
    text = mix.report(cells, {}, args, None)
    assert "| 200 | stateless | 32 | 25.0x | 10.00 | - | **MET** |" in text
    assert "| 200 | stateless | 100.0 | 400.0 | **MET** |" in text
    assert text.startswith(mix.BEGIN) and text.rstrip().endswith(mix.END)


def test_report_takes_the_envelope_apart_over_the_passthrough() -> None:
    args = argparse.Namespace(sizes=[200], clients=["stateless"], configs=[*mix.CONFIGS, *mix.PARTS], workers=[1],
                              concurrency=[32], duration=2.0, warmup=0.5, ledger_cap=None)

    def cell(config: str, cpu: float) -> mix.Cell:
        return mix.Cell(200, "stateless", config, 1, 32, 1000.0, 1.0, 2.0, 1000, cpu, 100.0)

    cells = [cell("passthrough", 200.0), cell("noflow", 370.0), cell("envelope-memory", 450.0),
             cell("envelope", 650.0)]
    text = mix.report(cells, {}, args, None)
    # request path 1.85x, the ledger in memory +0.40x, the SQLite store +1.00x: 3.25x in all.
    assert "| 200 | stateless | 32 | 200.0 | 1.85 | +0.40 | +1.00 | 3.25 |" in text
    # Without the parts measured, no such table.
    assert "Where the full envelope's CPU goes" not in mix.report(cells[:1] + cells[3:], {}, args, None)


@pytest.mark.parametrize("name", ["envelope", "envelope-memory", "noflow"])
def test_ledger_cap_reaches_every_envelopes_policy_and_the_policy_loads(name: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # --ledger-cap: a run of 5 KB outputs that fits its cap writes every output's fingerprints;
    # noflow keeps its `mode: off` beside it (one file only may hold `dataflow:`).
    args = mix.parse_args(["--ledger-cap", "4000000"])
    monkeypatch.setattr(R, "DATAFLOW", mix.dataflow_settings(args))
    dataflow = load_policy(R.envelope_policy(tmp_path, name)).document.dataflow
    assert dataflow is not None and dataflow.ledger_cap == 4_000_000
    # The bench policy's mode (no section: shadow) stays: only the cap moves.
    assert dataflow.mode == ("off" if name == "noflow" else "shadow")
    monkeypatch.setattr(R, "DATAFLOW", {})
    assert R.envelope_policy(tmp_path, "envelope") == R.POLICY_DIR


def test_report_says_whether_the_run_overflows_its_cap() -> None:
    args = argparse.Namespace(sizes=[5000], clients=["stateless"], configs=["passthrough", "envelope"], workers=[1],
                              concurrency=[1], duration=2.0, warmup=0.5, ledger_cap=None)
    cells = [mix.Cell(5000, "stateless", c, 1, 1, 1000.0, 1.0, 2.0, 1000, 500.0, 100.0)
             for c in ("passthrough", "envelope")]
    assert "overflows (coarse)" in mix.report(cells, {}, args, None)
    args.ledger_cap = 4_000_000
    text = mix.report(cells, {}, args, None)
    assert "raised to 4,000,000" in text and "overflows (coarse)" not in text
