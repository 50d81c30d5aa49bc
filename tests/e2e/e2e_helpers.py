"""Helpers shared by the end-to-end tests (real proxy process, real SDK upstreams)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

# The repository root, so `tests.harness` imports however pytest was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.harness import FIXTURE_POLICIES, ROOT, free_port, stop, upstream_server, wait_port  # noqa: F401

EXE = Path(sys.executable).with_name("envelope-proxy")
CLI = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "proxy"]


def cli(*args: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run `envelope-proxy <args>` to completion."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=kw.pop("cwd", ROOT), **kw)


def fixture_policy() -> dict[str, Any]:
    """The fixture policy directory merged into one document (tools.yaml + principals.yaml)."""
    yaml = YAML(typ="safe")
    tools = yaml.load((FIXTURE_POLICIES / "tools.yaml").read_text())
    principals = yaml.load((FIXTURE_POLICIES / "principals.yaml").read_text())
    return {**tools, "principals": principals["principals"]}


def write_policy(directory: Path, upstreams: dict[str, dict[str, Any]],
                 tools: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """A policy directory with the fixture's notes tools copied once per upstream name.

    `upstreams` maps each new upstream name to its policy entry (url, timeout...). Tool keys and
    rule ids keep their names with the `notes.` prefix replaced by the upstream name.
    """
    base = fixture_policy()
    doc: dict[str, Any] = {"version": 1, "upstreams": {}, "defaults": base["defaults"],
                           "tools": {}, "principals": base["principals"]}
    for name, entry in upstreams.items():
        doc["upstreams"][name] = {"url": "http://127.0.0.1:1/mcp", "timeout": "5s", **entry}
        for key, policy in (tools or base["tools"]).items():
            doc["tools"][name + key[len("notes"):]] = policy
    doc.update(overrides)
    return write_doc(directory, doc)


def write_doc(directory: Path, doc: dict[str, Any]) -> Path:
    """`directory` holding one policy file, `policy.yaml`, with `doc` (JSON is YAML)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(json.dumps(doc, indent=2))
    return directory


def mail_policy(directory: Path, dataflow: dict[str, Any]) -> Path:
    """A policy for `mail_server`: its page reader and an ungated `send_email` sink (so a flagged
    send is refused by the flow check, not held for approval), with `dataflow` as given."""
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"mail": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "tools": {
            "mail.fetch_page": {"effect": "read"},
            "mail.send_email": {"effect": "external", "approval": {"required": False, "wait": "0s"}},
        },
        "dataflow": dataflow,
    })


@contextlib.contextmanager
def mail_server() -> Iterator[str]:
    """The mail fixture upstream (`mail_server.py`: a page with an injected instruction,
    secrets, a send_email sink) in its own process; yields its MCP URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "e2e" / "mail_server.py"),
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)
