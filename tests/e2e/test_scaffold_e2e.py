"""`envelope-proxy scaffold` against real MCP SDK servers (Streamable HTTP and stdio), then
`check --strict` and `test` on what it wrote, as an operator runs them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import ROOT, cli, free_port, stop, wait_port
from ruamel.yaml import YAML

from proxy.policy.schemas import compile_schema

SERVER = ROOT / "tests" / "e2e" / "scaffold_server.py"
# tool -> (effect, gated, output), from scaffold_server.py's annotations.
EXPECTED = {
    "search": ("read", False, "untrusted"),
    "get_record": ("read", False, "trusted"),
    "save_contact": ("write", False, "trusted"),
    "send_email": ("external", True, "untrusted"),
    "drop_table": ("destructive", True, "trusted"),
    "mystery": ("destructive", True, "untrusted"),
}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


def _schemas() -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(SERVER.parent))
    from scaffold_server import build_server

    return {t.name: t.input_schema for t in asyncio.run(build_server().list_tools())}


def _load(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text())


def _assert_scaffold(out: Path, name: str) -> None:
    """What the files say, and that the proxy's own commands accept them."""
    text = (out / f"{name}.yaml").read_text()
    policy = _load(out / f"{name}.yaml")
    assert set(policy["tools"]) == {f"{name}.{t}" for t in EXPECTED}  # every page was listed
    for tool, (effect, gated, output) in EXPECTED.items():
        entry = policy["tools"][f"{name}.{tool}"]
        assert entry["effect"] == effect and entry["output"] == output, (tool, entry)
        assert ("approval" in entry) == gated and entry.get("approval", {"required": True}) == {"required": True}
    assert text.count("# derived from annotations: ") == len(EXPECTED)
    assert "effect: read  # derived from annotations: readOnlyHint: true, openWorldHint: false" in text

    cases = _load(out / "tests" / f"{name}.yaml")["cases"]
    schemas = _schemas()
    assert len(cases) == len(EXPECTED)
    for case in cases:
        tool = case["call"]["tool"].split(".", 1)[1]
        _, gated, _ = EXPECTED[tool]
        want = ({"verdict": "deny", "code": "approval_pending", "check": "approval",
                 "rule": f"tools.{name}.{tool}.approval"} if gated else {"verdict": "allow", "code": "ok"})
        assert case["expect"] == want
        # The arguments are valid for the server's own input schema (enum, bounds, format, nesting).
        assert compile_schema(schemas[tool]).is_valid(case["call"]["arguments"]), case
    by_tool = {c["call"]["tool"]: c["call"]["arguments"] for c in cases}
    assert by_tool[f"{name}.search"] == {"query": "x", "mode": "fast", "limit": 5}
    assert by_tool[f"{name}.save_contact"] == {"name": "x", "address": {"street": "x", "zip_code": 1000}}

    check = cli("check", "--strict", str(out))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "0 misconfigurations" in check.stdout
    test = cli("test", str(out))
    assert test.returncode == 0, test.stdout + test.stderr
    assert f"{len(EXPECTED)}/{len(EXPECTED)} cases passed" in test.stdout


def test_scaffold_from_a_streamable_http_server(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "policies"
    done = cli("scaffold", "fixture", "--url", server_url, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == (f"wrote {out}/fixture.yaml (6 tools, 3 gated) and "
                                   f"{out}/tests/fixture.yaml (6 cases)")
    assert _load(out / "fixture.yaml")["upstreams"] == {"fixture": {"url": server_url}}
    _assert_scaffold(out, "fixture")


def test_scaffold_refuses_to_overwrite_without_force(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "p"
    assert cli("scaffold", "fx", "--url", server_url, "--out", str(out)).returncode == 0
    (out / "fx.yaml").write_text("# reviewed by hand\n")
    again = cli("scaffold", "fx", "--url", server_url, "--out", str(out))
    assert again.returncode == 2
    assert again.stderr == f"envelope-proxy scaffold: {out}/fx.yaml exists (use --force to overwrite)\n"
    assert (out / "fx.yaml").read_text() == "# reviewed by hand\n"
    forced = cli("scaffold", "fx", "--url", server_url, "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    _assert_scaffold(out, "fx")


def test_scaffold_from_a_stdio_server(tmp_path: Path) -> None:
    out = tmp_path / "policies"
    done = cli("scaffold", "local", "--out", str(out), "--", sys.executable, str(SERVER))
    assert done.returncode == 0, done.stdout + done.stderr
    text = (out / "local.yaml").read_text()
    assert "The proxy launches it" in text
    assert f"{sys.executable} {SERVER}" in text
    assert _load(out / "local.yaml")["upstreams"] == {"local": {"command": [sys.executable, str(SERVER)]}}
    _assert_scaffold(out, "local")


def test_an_unreachable_server_writes_nothing(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp"
    done = cli("scaffold", "gone", "--url", url, "--out", str(tmp_path), "--timeout", "10")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"envelope-proxy scaffold: cannot list the tools of {url}: ")
    assert not any(tmp_path.iterdir())
