"""The scale bench's pieces (bench/scale.py), without running a bench: the policy it serves must
hold the tools it says, with the tool called among them and a ledger cap that keeps one run from
overflowing (an overflowed run records nothing more: the one-run cell would flatter the
envelope); the wrk script must spread the calls over the runs; the report's ratios are over the
small cell of the same concurrency."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import mix  # noqa: E402
import scale  # noqa: E402

from proxy.policy.loader import load_policy  # noqa: E402


def test_the_policy_holds_the_tools_asked_and_never_overflows_one_run(tmp_path: Path) -> None:
    revision = load_policy(scale.policy_dir(tmp_path, 150))
    assert len(revision.tools) == 150
    assert "bench.search_issues" in revision.tools  # the tool every call makes
    assert revision.document.dataflow.ledger_cap == scale.LEDGER_CAP == 4_000_000


def test_the_wrk_script_draws_a_run_per_request(tmp_path: Path) -> None:
    client = mix.Client("stateless", "http://127.0.0.1:1/mcp/bench", '{"x": "a \\"q\\""}',
                        {"Mcp-Method": "tools/call"})
    text = scale.script(client, tmp_path, 10_000).read_text()
    assert 'wrk.headers["X-Envelope-Run"] = "r" .. math.random(0, 10000 - 1)' in text
    assert 'wrk.headers["Mcp-Method"] = "tools/call"' in text
    assert 'wrk.body = "{\\"x\\": \\"a \\\\\\"q\\\\\\"\\"}"' in text


def test_the_report_divides_by_the_small_cell_of_the_same_concurrency() -> None:
    args = argparse.Namespace(tools=[10, 1000], runs=[1, 10_000], concurrency=[1, 32])
    cells = [scale.Cell(10, 1, 1, 900, 1.0, 2.0, 9000, 1000.0, 500),
             scale.Cell(1000, 10_000, 1, 800, 1.2, 2.0, 8000, 1100.0, 500),
             scale.Cell(10, 1, 32, 1000, 30.0, 60.0, 10_000, 800.0, 500),
             scale.Cell(1000, 10_000, 32, 900, 33.0, 60.0, 9000, 1200.0, 500)]
    rows = [line for line in scale.report(cells, args).splitlines() if line.startswith("| 1,000 ")]
    assert rows == ["| 1,000 | 10,000 | 1 | 800 | 1.200 | 2.000 | 1,100.0 | 1.10 | 1.20 |",
                    "| 1,000 | 10,000 | 32 | 900 | 33.000 | 60.000 | 1,200.0 | 1.50 | 1.10 |"]
