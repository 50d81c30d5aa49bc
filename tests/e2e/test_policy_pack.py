"""The example policy pack in policies/ as CI runs it: `check`, then `test` with coverage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from e2e_helpers import ROOT, cli

from proxy.policy.cel import available_engines

PACK = ROOT / "policies"


def test_check_passes_with_no_misconfigurations() -> None:
    done = cli("check", str(PACK), "--strict")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 misconfigurations" in done.stdout


def test_pack_tests_pass_with_coverage_over_90() -> None:
    done = cli("test", str(PACK), "--coverage", "--threshold", "90")
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("coverage: "))
    assert float(line.split()[1].rstrip("%")) >= 90


def test_json_report_parses() -> None:
    done = cli("test", str(PACK), "--format", "json", "--coverage")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] is True and data["failed"] == 0 and data["failures"] == []
    assert len(data["cases"]) == data["passed"] > 40
    assert data["coverage"]["percent"] >= 90


def test_a_changed_expectation_fails_naming_the_case(tmp_path: Path) -> None:
    pack = tmp_path / "policies"
    shutil.copytree(PACK, pack)
    cases = pack / "tests" / "github.yaml"
    text = cases.read_text()
    assert "rule: no-force-push" in text
    cases.write_text(text.replace("rule: no-force-push", "rule: own-org"))
    done = cli("test", str(pack))
    assert done.returncode == 1, done.stdout
    assert f"FAIL: force push is forbidden ({cases}:" in done.stdout
    assert "rule: expected own-org, got no-force-push" in done.stdout


@pytest.mark.parametrize("engine", ["cel-cpp", "cel-python"])
def test_pack_on_both_engines(engine: str) -> None:
    if engine not in available_engines():
        pytest.skip(f"{engine} is not installed")
    by_flag = cli("test", str(PACK), "--cel-engine", engine, "-v")
    assert by_flag.returncode == 0, by_flag.stdout
    assert f"cases passed ({engine})" in by_flag.stdout
    by_env = cli("test", str(PACK), env={**os.environ, "ENVELOPE_CEL_ENGINE": engine})
    assert by_env.returncode == 0, by_env.stdout
    assert f"({engine})" in by_env.stdout
