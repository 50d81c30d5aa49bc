"""The default serve path imports no optional library: a feature's library is imported when the
config enables it (start-up CPU is what a readiness probe and every worker restart wait for).

Each test runs a fresh interpreter (this process has imported everything already) and reads
its `sys.modules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import proxy

ROOT = Path(proxy.__file__).resolve().parent.parent

# Libraries of features off by default (JWT identity, traces, the MCP SDK of the demo tool
# server, Redis) and cel-python, which the policy load imports for its lint, not the import.
OPTIONAL = ("jwt", "cryptography", "celpy", "lark", "opentelemetry", "mcp", "redis")


def _loaded(script: str, *argv: str) -> set[str]:
    """The top-level packages `script` leaves in `sys.modules` (a fresh interpreter)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    script += "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


SERVE_PATH = """
import proxy.cli, proxy.cli.serve, proxy.app.runtime
from proxy.config import Config
from proxy.identity import Identity
Identity(Config().identity)
"""


def test_the_default_serve_path_imports_no_optional_library() -> None:
    loaded = _loaded(SERVE_PATH)
    assert "aiohttp" in loaded  # the detector sees what the serve path does import
    assert sorted(loaded & set(OPTIONAL)) == []
    assert "numpy" not in loaded  # the policy load imports it when data flow is recorded


CHAIN = """
import pathlib, sys, tempfile
from proxy.envelope.pipeline import Chain
from proxy.envelope.tools import ToolRegistry
from proxy.policy.loader import load_policy
policies = pathlib.Path(tempfile.mkdtemp())
(policies / "p.yaml").write_text(
    "version: 1\\nupstreams: {docs: {url: 'http://127.0.0.1:1/mcp'}}\\n"
    "tools: {docs.read: {effect: read}}\\n" + sys.argv[1])
revision = load_policy(policies, "cel-python")
assert "numpy" not in sys.modules, "imported by the policy load itself"
Chain(revision, ToolRegistry())
"""


def test_a_chain_that_records_data_flow_imports_numpy_at_policy_load() -> None:
    """The fingerprints' numpy is imported when the chain is built (before /readyz), never by
    the first call; a policy with `dataflow: {mode: off}` never imports it."""
    assert "numpy" in _loaded(CHAIN, "")  # no dataflow section: shadow, recorded
    assert "numpy" in _loaded(CHAIN, "dataflow: {mode: enforce}")
    assert "numpy" not in _loaded(CHAIN, "dataflow: {mode: off}")


def test_jwt_identity_imports_pyjwt_when_configured() -> None:
    loaded = _loaded(SERVE_PATH + """
from proxy.identity import IdentityConfig
Identity(IdentityConfig(mode="jwt", algorithms=["HS256"], key="k" * 32))
""")
    assert "jwt" in loaded


def test_jwt_identity_without_pyjwt_is_a_start_up_error() -> None:
    """Fail closed: jwt mode whose library cannot be imported refuses to build, never serves."""
    loaded = _loaded("""
import sys
sys.modules["jwt"] = None  # an import of jwt now raises ImportError
from proxy.errors import ConfigError
from proxy.identity import Identity, IdentityConfig
try:
    Identity(IdentityConfig(mode="jwt", algorithms=["HS256"], key="k" * 32))
except ConfigError as exc:
    assert "PyJWT" in str(exc), exc
else:
    raise SystemExit("jwt mode built without PyJWT")
""")
    assert "proxy" in loaded


def test_the_serve_path_import_builds_no_guardrail_table() -> None:
    """The invisible-character class (a scan of 135,000 code points) waits for a policy with
    guardrails."""
    _loaded(SERVE_PATH + """
from proxy.envelope.invisible import invisible_class
assert invisible_class.cache_info().currsize == 0, "built at import"
""")
