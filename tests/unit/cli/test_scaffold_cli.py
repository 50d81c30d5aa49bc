"""`envelope-proxy scaffold` argument handling: the command line after `--`, usage errors, and
refusing to overwrite (the server is replaced by a stub list; e2e runs real servers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import proxy.tools.scaffold as engine
from proxy.cli import main

TOOLS = [{"name": "look", "annotations": {"readOnlyHint": True}, "inputSchema": {"type": "object"}}]


@pytest.fixture
def listed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, list[str]]]:
    """Stands in for the server: records what would be listed and answers TOOLS."""
    calls: list[tuple[str | None, list[str]]] = []

    async def fake(url: str | None = None, command: Sequence[str] = (), *, seconds: float = 30.0,
                   env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        calls.append((url, list(command)))
        return TOOLS

    monkeypatch.setattr(engine, "list_tools", fake)
    return calls


def test_the_command_after_dashes_is_the_server(tmp_path: Path, listed: list[Any]) -> None:
    code = main(["scaffold", "srv", "--out", str(tmp_path), "--", "python", "server.py", "--out", "-v"])
    assert code == 0
    assert listed == [(None, ["python", "server.py", "--out", "-v"])]
    assert "srv.look:" in (tmp_path / "srv.yaml").read_text()
    assert "srv.look" in (tmp_path / "tests" / "srv.yaml").read_text()


@pytest.mark.parametrize("argv", [
    ["scaffold", "srv"],                                                    # neither
    ["scaffold", "srv", "--url", "http://127.0.0.1:9/mcp", "--", "python"],  # both
    ["scaffold", "bad.name", "--url", "http://127.0.0.1:9/mcp"],            # not an upstream name
    ["scaffold", "srv", "--url", "ftp://127.0.0.1/mcp"],                     # not a policy URL
])
def test_usage_errors_exit_2_before_connecting(argv: list[str], tmp_path: Path, listed: list[Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv[:2], "--out", str(tmp_path), *argv[2:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("envelope-proxy scaffold: ")
    assert listed == [] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("existing", ["srv.yaml", "tests/srv.yaml"])
def test_an_existing_file_is_not_overwritten_without_force(
        existing: str, tmp_path: Path, listed: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / existing
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# mine\n")
    argv = ["scaffold", "srv", "--url", "http://127.0.0.1:9/mcp", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"envelope-proxy scaffold: {path} exists (use --force to overwrite)\n"
    assert path.read_text() == "# mine\n" and listed == []
    assert main([*argv, "--force"]) == 0
    assert "srv.look" in path.read_text()
