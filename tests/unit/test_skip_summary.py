"""tests/conftest.py's run summary: a run that skips tests names each skipped tier, why, and
how to run it locally (a fresh machine skips whole tiers, and `-q` alone hides why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SKIPPING = '''\
import pytest

def test_redis():
    pytest.skip("redis-server not found on PATH (apt-get install -y redis-server)")

def test_node():
    pytest.skip("no Node >= 22 found (no node binary)")

def test_browser():
    pytest.skip("/usr/bin/chromium is missing (apt-get install chromium chromium-driver)")

def test_native():
    pytest.skip("the native winnowing extension is not built (proxy.envelope.dataflow._winnow)")

@pytest.mark.skipif(True, reason="needs /dev/full")
def test_other():
    pass

def test_runs():
    pass
'''


def _run(tmp_path: Path, tests: str) -> str:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_tiers.py").write_text(tests)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_summary_names_each_skipped_tier_and_how_to_run_it(tmp_path: Path) -> None:
    out = _run(tmp_path, SKIPPING)
    assert "skipped test tiers" in out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines()
             if line.split(":", 1)[0] in ("redis", "promtool", "browser", "node", "native", "other")}
    assert set(lines) == {"redis", "browser", "node", "native", "other"}, out
    assert "apt-get install redis-server" in lines["redis"]
    assert "npm ci --prefix tests/node" in lines["node"]
    assert "chromium chromium-driver" in lines["browser"]
    assert "apt-get install gcc" in lines["native"]
    assert "needs /dev/full" in lines["other"]


def test_no_summary_when_nothing_skips(tmp_path: Path) -> None:
    assert "skipped test tiers" not in _run(tmp_path, "def test_runs():\n    pass\n")
