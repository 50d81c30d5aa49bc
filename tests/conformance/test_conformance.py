"""The official MCP conformance suite against the fixture server, directly and through the proxy.

`@modelcontextprotocol/conformance` 0.1.16 (tests/node/package.json) runs its server scenarios
(`server --suite all --spec-version <rev> -o <dir>`, one `checks.json` per scenario) against
tests/conformance/fixture_server.py, once at the fixture's own URL and once at
`/mcp/fixture` of a real `envelope-proxy serve` process (policy: tests/conformance/policies),
and for 2025-11-25 once more through a proxy that launches the fixture as a stdio upstream
(`fixture_server.py --stdio` as the upstream's `command`) and once through a proxy serving with
`listener: aiohttp` (aiohttp's HTTP server instead of the default `fast` one).

Revisions: the suite's server scenarios exist for 2025-06-18 and 2025-11-25 only (it has none for
2026-07-28; `test_suite_revisions` notices when that changes). Its client always offers
2025-11-25, so the 2025-06-18 fixture pins the negotiated revision to 2025-06-18.

A scenario passes when none of its checks is a FAILURE. Asserted per revision:
- every scenario that fails directly is listed in expected-failures.yaml with its reason, and
  every listed one still fails (so the list stays honest);
- every scenario that passes directly passes through the proxy, and no check that is a SUCCESS
  directly turns into a WARNING or FAILURE through the proxy (losses are proxy bugs; known ones
  go in KNOWN_PROXY_LOSSES, which turns the assertion into a strict xfail naming the bug);
- the proxy allowed and forwarded every tools/call (a policy refusal is an isError result, which
  some of the suite's checks would not notice).

Node: needs node >= 22 (tests/node/node_modules/.bin/node from `npm ci --prefix tests/node` on
linux-x64, or ENVELOPE_NODE, or `node` on PATH) and tests/node/node_modules. Missing -> skip, or
fail when ENVELOPE_REQUIRE_NODE=1 (CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.harness import ROOT, free_port, proxy_process, stop, wait_port

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
NODE_DIR = ROOT / "tests" / "node"
SUITE_PKG = NODE_DIR / "node_modules" / "@modelcontextprotocol" / "conformance"
SUITE_JS = SUITE_PKG / "dist" / "index.js"
SUITE_VERSION = "0.1.16"
POLICIES = HERE / "policies"
EXPECTED_FAILURES = HERE / "expected-failures.yaml"
REVISIONS = ("2025-06-18", "2025-11-25")
UPSTREAM = "fixture"
RUN_TIMEOUT = 150

# Scenarios lost through the proxy that are known proxy bugs: {revision: {scenario: bug}}.
# A non-empty entry makes test_nothing_lost_through_proxy a strict xfail for exactly those.
KNOWN_PROXY_LOSSES: dict[str, dict[str, str]] = {}

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RESULT_DIR = re.compile(r"^server-(?P<scenario>.+)-\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}-\d{3}Z$")
GRADED = ("SUCCESS", "FAILURE", "WARNING")


class KnownProxyLoss(AssertionError):
    """Exactly the losses listed in KNOWN_PROXY_LOSSES happened (the strict xfail's exception)."""


def _missing(reason: str) -> None:
    if os.environ.get("ENVELOPE_REQUIRE_NODE") == "1":
        pytest.fail(f"ENVELOPE_REQUIRE_NODE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _node_major(path: str) -> int | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"v(\d+)\.", out.strip())
    return int(m.group(1)) if m else None


def find_node() -> str:
    """A node >= 22, else skip (or fail under ENVELOPE_REQUIRE_NODE=1) naming what was seen."""
    candidates = [os.environ.get("ENVELOPE_NODE"), str(NODE_DIR / "node_modules" / ".bin" / "node"),
                  shutil.which("node")]
    seen = []
    for cand in candidates:
        if not cand or not Path(cand).exists():
            continue
        major = _node_major(cand)
        if major is not None and major >= 22:
            return cand
        seen.append(f"{cand} (v{major})" if major else f"{cand} (unusable)")
    _missing("the MCP conformance suite needs node >= 22; found "
             + (", ".join(seen) or "no node at all")
             + ". Install: `npm ci --prefix tests/node` (linux-x64 brings node 22) "
               "or set ENVELOPE_NODE=/path/to/node22")
    raise AssertionError("unreachable")


def find_suite() -> Path:
    if not SUITE_JS.exists():
        _missing(f"{SUITE_JS.relative_to(ROOT)} is missing: run `npm ci --prefix tests/node`")
    version = json.loads((SUITE_PKG / "package.json").read_text())["version"]
    if version != SUITE_VERSION:
        _missing(f"tests/node has @modelcontextprotocol/conformance {version}, expected "
                 f"{SUITE_VERSION}: run `npm ci --prefix tests/node`")
    return SUITE_JS


@pytest.fixture(scope="module")
def node() -> str:
    path = find_node()
    find_suite()
    return path


def suite(node: str, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(node).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_COLOR": "1"}
    return subprocess.run([node, str(SUITE_JS), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=NODE_DIR, env=env)


# -- one suite run, parsed -------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    checks: list[dict[str, Any]]
    output: str  # the suite's console output for this scenario

    @property
    def failed(self) -> bool:
        return not self.checks or any(c["status"] == "FAILURE" for c in self.checks)

    def statuses(self) -> dict[str, str]:
        """Graded checks by id (ids repeat in a few scenarios: keep the worst)."""
        rank = {"SUCCESS": 0, "WARNING": 1, "FAILURE": 2}
        out: dict[str, str] = {}
        for c in self.checks:
            if c["status"] in GRADED and rank[c["status"]] >= rank.get(out.get(c["id"], ""), -1):
                out[c["id"]] = c["status"]
        return out

    def summary(self) -> str:
        bad = [f"    {c['status']} {c['id']}: {c.get('errorMessage') or c.get('description')}"
               for c in self.checks if c["status"] in ("FAILURE", "WARNING")]
        return "\n".join(bad) or "    (no checks recorded: the scenario did not run)"


@dataclass
class Run:
    label: str
    url: str
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    stdout: str = ""
    seconds: float = 0.0

    def passed(self) -> set[str]:
        return {n for n, s in self.scenarios.items() if not s.failed}

    def failed(self) -> set[str]:
        return {n for n, s in self.scenarios.items() if s.failed}


def run_suite(node: str, url: str, revision: str, out_dir: Path, label: str) -> Run:
    start = time.monotonic()
    proc = suite(node, "server", "--url", url, "--suite", "all", "--spec-version", revision,
                 "-o", str(out_dir))
    run = Run(label, url, stdout=ANSI.sub("", proc.stdout + proc.stderr),
              seconds=time.monotonic() - start)
    sections = re.split(r"^=== Running scenario: (.+) ===$", run.stdout, flags=re.M)
    outputs = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert outputs, f"{label}: the suite ran no scenario (exit {proc.returncode}):\n{run.stdout}"
    checks: dict[str, list[dict[str, Any]]] = {}
    for d in out_dir.iterdir():
        m = RESULT_DIR.match(d.name)
        if m and (d / "checks.json").exists():
            checks[m.group("scenario")] = json.loads((d / "checks.json").read_text())
    for name, text in outputs.items():
        run.scenarios[name] = Scenario(name, checks.get(name, []), text.strip())
    return run


# -- the world per revision ------------------------------------------------------------------


@dataclass
class Results:
    revision: str
    direct: Run
    proxied: Run
    audit: list[dict[str, Any]]
    proxy_log: str


def fixture_server(tmp: Path, revision: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = tmp / f"fixture-{port}.log"
    cmd = [sys.executable, str(HERE / "fixture_server.py"), "--port", str(port)]
    if revision != "2025-11-25":  # the suite's client asks for 2025-11-25; pin older revisions
        cmd += ["--protocol-version", revision]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_port(port, proc)
    return proc, f"http://127.0.0.1:{port}/mcp", log


@pytest.fixture(scope="module", params=REVISIONS)
def results(request: pytest.FixtureRequest, node: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    revision: str = request.param
    tmp = tmp_path_factory.mktemp(f"conformance-{revision}")
    proc, url, _ = fixture_server(tmp, revision)
    try:
        direct = run_suite(node, url, revision, tmp / "direct", "direct")
        with proxy_process(tmp, {UPSTREAM: url}, policies=POLICIES,
                           identity={"mode": "static", "principal": "conformance"}) as pp:
            proxied = run_suite(node, pp.url(UPSTREAM), revision, tmp / "proxied", "proxied")
            audit, log = pp.audit_records(), pp.log()
        yield Results(revision, direct, proxied, audit, log)
    finally:
        stop(proc)


# -- assertions ------------------------------------------------------------------------------


def expected_failures(revision: str) -> dict[str, str]:
    doc = YAML(typ="safe").load(EXPECTED_FAILURES.read_text()) or {}
    assert set(doc) <= set(REVISIONS), f"unknown revisions in {EXPECTED_FAILURES.name}: {set(doc)}"
    entries = doc.get(revision) or {}
    for name, reason in entries.items():
        assert isinstance(reason, str) and reason.strip(), f"{revision} {name}: give the reason"
    return dict(entries)


def test_suite_revisions(node: str) -> None:
    """The suite's server scenarios cover exactly the revisions this test runs."""
    out = suite(node, "list", "--server", timeout=60).stdout
    tags = re.findall(r"^\s+- \S+ \[([^\]]*)\]$", out, flags=re.M)
    assert tags, out
    revisions = {v for t in tags for v in t.split(",")}
    assert revisions == set(REVISIONS), (
        f"the suite's server scenarios now cover {sorted(revisions)}; update REVISIONS "
        f"(the proxy supports 2025-06-18, 2025-11-25 and 2026-07-28)")


def test_direct_failures_are_listed(results: Results) -> None:
    listed = expected_failures(results.revision)
    direct = results.direct
    unlisted = sorted(direct.failed() - set(listed))
    stale = sorted(set(listed) & direct.passed())
    unknown = sorted(set(listed) - set(direct.scenarios))
    problems = []
    for name in unlisted:
        problems.append(f"{name} fails directly but is not in {EXPECTED_FAILURES.name}:\n"
                        f"{direct.scenarios[name].summary()}\n{direct.scenarios[name].output}")
    for name in stale:
        problems.append(f"{name} is listed in {EXPECTED_FAILURES.name} ({listed[name]}) but passes "
                        f"directly now: remove it")
    for name in unknown:
        problems.append(f"{name} is listed but the suite ran no such scenario for {results.revision}")
    assert not problems, f"[{results.revision}] " + "\n\n".join(problems)


def lost_through_proxy(res: Results) -> dict[str, str]:
    """Scenario -> evidence, for everything that passes directly but not through the proxy."""
    lost: dict[str, str] = {}
    for name in sorted(res.direct.passed()):
        via = res.proxied.scenarios.get(name)
        if via is None:
            lost[name] = "    the suite did not run it through the proxy"
            continue
        direct_status = res.direct.scenarios[name].statuses()
        via_status = via.statuses()
        degraded = [f"    check {cid}: SUCCESS directly, {via_status.get(cid, 'missing')} through the proxy"
                    for cid, st in direct_status.items()
                    if st == "SUCCESS" and via_status.get(cid) != "SUCCESS"]
        if via.failed or degraded:
            lost[name] = "\n".join([*degraded, via.summary(), via.output])
    return lost


def test_nothing_lost_through_proxy(results: Results, request: pytest.FixtureRequest) -> None:
    revision = results.revision
    known = KNOWN_PROXY_LOSSES.get(revision, {})
    if known:
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=KnownProxyLoss,
            reason="; ".join(f"{s}: {b}" for s, b in known.items())))
    lost = lost_through_proxy(results)
    message = f"[{revision}] scenarios that pass directly but not through the proxy:\n\n" + "\n\n".join(
        f"{name}{' (known: ' + known[name] + ')' if name in known else ''}:\n{evidence}"
        for name, evidence in lost.items())
    if known and set(lost) == set(known):
        raise KnownProxyLoss(message)
    assert not lost, message + f"\n\nproxy log (tail):\n{results.proxy_log[-4000:]}"


def test_proxy_forwarded_every_tool_call(results: Results) -> None:
    """No tools/call was refused: the suite's simple checks would accept a refusal's text."""
    records = results.audit
    assert records, "the proxy wrote no audit record: the suite's tools/call never reached it"
    refused = [r for r in records if r["verdict"] != "allow" or r["upstream_status"] != 200]
    assert not refused, json.dumps(refused, indent=2)
    called = {r["tool"] for r in records}
    assert {"test_simple_text", "test_sampling", "test_elicitation"} <= called, called
    # test_error_handling is the one tool whose result is an error.
    assert {r["tool"] for r in records if r["extra"].get("is_error")} == {"test_error_handling"}


def test_report(results: Results, capsys: pytest.CaptureFixture[str]) -> None:
    """Per-revision pass counts (shown with `pytest -s` or `-rA`)."""
    d, p = results.direct, results.proxied
    line = (f"conformance {results.revision}: direct {len(d.passed())}/{len(d.scenarios)} "
            f"({d.seconds:.1f}s), through the proxy {len(p.passed())}/{len(p.scenarios)} "
            f"({p.seconds:.1f}s)")
    warned = sorted(n for n, s in p.scenarios.items() if "WARNING" in s.statuses().values())
    with capsys.disabled():
        print(f"\n{line}; scenarios with warnings through the proxy: {warned}")
    assert set(d.scenarios) == set(p.scenarios), (set(d.scenarios) ^ set(p.scenarios))


# -- the fixture launched as a stdio upstream --------------------------------------------------
# The same suite through `/mcp/fixture` of a proxy that launches the fixture itself
# (`fixture_server.py --stdio` as the upstream's `command`): one child per suite session. The
# suite ends none of its 32 sessions (no DELETE), so the pool is sized for them and idle
# children are reaped meanwhile. 2025-11-25 only: the bridge is revision-blind and one more run
# costs two minutes.
STDIO_REVISION = "2025-11-25"
# Warns directly too: the suite sends `mcp-protocol-version: 2025-03-26` on its raw requests,
# so no SDK server primes or closes that stream (see the resumption note below).
WARNS_ANYWHERE = {"server-sse-polling"}


@pytest.fixture(scope="module")
def stdio_run(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Run, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("conformance-stdio")
    command = [sys.executable, str(HERE / "fixture_server.py"), "--stdio"]
    with proxy_process(tmp, {}, policies=POLICIES,
                       identity={"mode": "static", "principal": "conformance"},
                       config={"upstreams": {UPSTREAM: {"command": command, "max_processes": 40,
                                                        "max_processes_per_principal": 40,
                                                        "idle_timeout": "15s"}}}) as pp:
        run = run_suite(node, pp.url(UPSTREAM), STDIO_REVISION, tmp / "stdio", "stdio")
        yield run, pp.audit_records()


def assert_nothing_lost(run: Run, audit: list[dict[str, Any]], revision: str) -> None:
    """A suite run through a proxy (no direct run beside it) lost nothing: it fails only the
    scenarios listed for `revision`, warns only where the suite warns anywhere, ran them all,
    and every tools/call was allowed and forwarded."""
    expected = set(expected_failures(revision))
    lost = sorted(run.failed() - expected)
    assert not lost, "\n\n".join(f"{n}:\n{run.scenarios[n].summary()}\n{run.scenarios[n].output}"
                                   for n in lost)
    warned = {n for n, sc in run.scenarios.items() if "WARNING" in sc.statuses().values()}
    assert warned <= WARNS_ANYWHERE, {n: run.scenarios[n].summary() for n in warned - WARNS_ANYWHERE}
    assert len(run.scenarios) >= 30, sorted(run.scenarios)
    refused = [r for r in audit if r["verdict"] != "allow" or r["upstream_status"] != 200]
    assert not refused, json.dumps(refused, indent=2)
    assert {"test_simple_text", "test_sampling", "test_elicitation"} <= {r["tool"] for r in audit}


def test_nothing_lost_through_a_stdio_upstream(stdio_run: tuple[Run, list[dict[str, Any]]]) -> None:
    run, audit = stdio_run
    assert_nothing_lost(run, audit, STDIO_REVISION)


# -- the same suite through aiohttp's server -------------------------------------------------
# The default `listener: fast` (proxy/app/fast_listener.py) serves the runs above; `listener:
# aiohttp` serves the same application with aiohttp's HTTP server: the suite once more through
# it, 2025-11-25 (the revision every client offers), so both listeners are held to the suite.
AIOHTTP_REVISION = "2025-11-25"


@pytest.fixture(scope="module")
def aiohttp_run(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Run, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("conformance-aiohttp")
    proc, url, _ = fixture_server(tmp, AIOHTTP_REVISION)
    try:
        with proxy_process(tmp, {UPSTREAM: url}, policies=POLICIES,
                           identity={"mode": "static", "principal": "conformance"},
                           config={"listener": {"kind": "aiohttp"}}) as pp:
            run = run_suite(node, pp.url(UPSTREAM), AIOHTTP_REVISION, tmp / "aiohttp", "aiohttp")
            yield run, pp.audit_records()
    finally:
        stop(proc)


def test_nothing_lost_through_the_aiohttp_listener(aiohttp_run: tuple[Run, list[dict[str, Any]]]) -> None:
    run, audit = aiohttp_run
    assert_nothing_lost(run, audit, AIOHTTP_REVISION)


# -- SEP-1699 resumption, which the suite does not exercise ------------------------------------
# The suite's `server-sse-polling` sends `mcp-protocol-version: 2025-03-26` on its raw requests,
# so an SDK server neither primes nor closes the stream and the scenario ends in warnings. This
# test drives `test_reconnection` at 2025-11-25: the server closes the POST stream after its
# priming event and the result must arrive on `GET` + `Last-Event-ID`.


@pytest.fixture(scope="module")
def resume_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("resume")
    proc, url, _ = fixture_server(tmp, "2025-11-25")
    try:
        with proxy_process(tmp, {UPSTREAM: url}, policies=POLICIES,
                           identity={"mode": "static", "principal": "conformance"}) as pp:
            yield {"direct": url, "proxied": pp.url(UPSTREAM)}
    finally:
        stop(proc)


@pytest.mark.parametrize("where", ["direct", "proxied"])
def test_reconnection_resumes_with_last_event_id(resume_world: dict[str, str], where: str) -> None:
    import httpx

    url = resume_world[where]
    hdrs = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "MCP-Protocol-Version": "2025-11-25"}
    with httpx.Client(timeout=10) as c:
        init = c.post(url, headers=hdrs, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        hdrs["Mcp-Session-Id"] = init.headers["mcp-session-id"]
        c.post(url, headers=hdrs, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"jsonrpc": "2.0", "id": "resume-1", "method": "tools/call",
                "params": {"name": "test_reconnection", "arguments": {}}}
        with c.stream("POST", url, headers=hdrs, json=call) as s:
            body = s.read().decode()
        ids = [line[3:].strip() for line in body.splitlines() if line.startswith("id:")]
        assert ids, f"no priming event on the POST stream: {body!r}"
        assert '"resume-1"' not in body, f"the POST stream answered the call before the resume: {body!r}"
        got = ""
        with c.stream("GET", url, headers={**hdrs, "Last-Event-ID": ids[-1],
                                           "Accept": "text/event-stream"}, timeout=10) as g:
            assert g.status_code == 200, g.status_code
            for chunk in g.iter_text():
                got += chunk
                if '"resume-1"' in got:
                    break
        assert "Reconnection test completed successfully" in got, got
