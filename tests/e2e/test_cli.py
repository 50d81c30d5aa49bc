"""The `envelope-proxy` command as an operator runs it: check, help, serve from env, demo."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import CLI, ROOT, cli

from tests.harness import FIXTURE_POLICIES, admin_ports, free_port, mcp_client, stop, wait_port

SERVE_FLAGS = ("--policies", "--listen", "--admin", "--state-dir")


def test_check_fixture_policies() -> None:
    done = cli("check", str(FIXTURE_POLICIES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok: {FIXTURE_POLICIES}")
    assert "4 tools" in done.stdout and "2 principals" in done.stdout


A_YAML = """\
version: 1
upstreams:
  notes: {url: "http://127.0.0.1:1/mcp"}
tools:
  notes.echo:
    effect: read
    colour: blue
  notes.write_note:
    effect: write
    allow: 'principal.id == '
"""
B_YAML = """\
tools:
  notes.search_notes:
    effect: read
  notes.echo:
    effect: read
"""


def test_check_broken_policy_names_every_problem(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(A_YAML)
    (tmp_path / "b.yaml").write_text(B_YAML)
    done = cli("check", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    expected = [
        (f"{a}:7:5: ", "unknown field 'colour'"),       # the key of the unknown field
        (f"{a}:10:29: ", "CEL"),                        # where the expression ends unfinished
        (f"{b}:4:3: ", "declared twice"),              # the second notes.echo key
    ]
    for prefix, words in expected:
        hits = [line for line in lines if line.startswith(prefix)]
        assert len(hits) == 1, (prefix, lines)
        assert words in hits[0]
    assert f"{a}:5:3" in next(line for line in lines if line.startswith(f"{b}:4:3: "))
    # Every problem line has the file:line:column: message shape.
    assert all(re.match(r"^/.+\.yaml:\d+:\d+: \S", line) for line in lines), lines
    assert len(lines) == 3
    assert "3 problems" in done.stderr


def test_check_reports_a_bad_pattern_once_with_nothing_else_on_stderr(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        'version: 1\nupstreams:\n  notes: {url: "http://127.0.0.1:1/mcp"}\ntools:\n'
        "  notes.echo:\n    effect: read\n    rules:\n"
        """      - {id: r1, forbid: 'args.text.matches("(a")', reason: "x"}\n""")
    done = cli("check", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f'{tmp_path / "a.yaml"}:8:45: CEL: invalid regular expression "(a": missing ): (a']
    # The problem is reported once, by `check`: RE2 logs nothing of its own to stderr (in
    # `serve`, such a line would sit among the JSON log lines).
    assert done.stderr.splitlines() == [f"1 problem in {tmp_path}"], done.stderr


def test_help() -> None:
    top = cli("--help")
    assert top.returncode == 0
    for command in ("serve", "check", "audit", "demo"):
        assert command in top.stdout
    serve = cli("serve", "--help")
    assert serve.returncode == 0
    for flag in SERVE_FLAGS:
        assert flag in serve.stdout
    demo = cli("demo", "--help")
    assert demo.returncode == 0
    for flag in SERVE_FLAGS:
        assert flag in demo.stdout


def test_top_level_help_mentions_serve_flags() -> None:
    top = cli("--help")
    for flag in SERVE_FLAGS:
        assert flag in top.stdout


def test_approvals_subcommand_help_lists_the_flags_the_tour_passes_after_it() -> None:
    # README's tour: `envelope-proxy approvals list --admin URL`, `approvals approve ID --admin URL`.
    for command in ("list", "show", "approve", "deny", "grants"):
        done = cli("approvals", command, "--help")
        assert done.returncode == 0, done.stderr
        for flag in ("--admin URL", "--token TOKEN", "--json"):
            assert flag in done.stdout, (command, done.stdout)


def test_serve_from_environment(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    env = {**os.environ, "ENVELOPE_LISTEN": f"127.0.0.1:{port}", "ENVELOPE_ADMIN": f"127.0.0.1:{admin}",
           "ENVELOPE_POLICIES": str(FIXTURE_POLICIES), "ENVELOPE_STATE_DIR": str(tmp_path / "state")}
    env.pop("ENVELOPE_CONFIG", None)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, "serve"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    try:
        wait_port(admin, proc)
        wait_port(port, proc)
        ready = httpx.get(f"http://127.0.0.1:{admin}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        assert ready.json()["ready"] is True  # plus per-upstream health, never a reason
        # Static identity by default: no bearer token needed; the listener answers MCP.
        resp = httpx.post(f"http://127.0.0.1:{port}/mcp/notes", content=b"{", timeout=5,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 400
        assert (tmp_path / "state" / "audit").is_dir()
    finally:
        rc = stop(proc)
    assert rc == 0, log.read_text()
    text = log.read_text()
    assert f"http://127.0.0.1:{port}/mcp/" in text
    assert "shutdown complete" in text


def test_serve_refuses_invalid_policy(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "a.yaml").write_text(A_YAML)
    env = {**os.environ, "ENVELOPE_LISTEN": f"127.0.0.1:{free_port()}",
           "ENVELOPE_ADMIN": f"127.0.0.1:{free_port()}", "ENVELOPE_STATE_DIR": str(tmp_path / "state")}
    done = cli("serve", "--policies", str(policies), cwd=tmp_path, env=env, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert f"{policies / 'a.yaml'}:7:5: unknown field 'colour'" in out
    assert f"{policies / 'a.yaml'}:10:29: CEL" in out
    assert "not starting" in out


def test_demo(tmp_path: Path) -> None:
    import anyio

    port, admin = free_port(), free_port()
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, "demo", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
             "--state-dir", str(tmp_path / "state")],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )

    async def use_it() -> None:
        async with mcp_client(f"http://127.0.0.1:{port}/mcp/demo", "legacy") as c:
            names = {t.name for t in (await c.list_tools()).tools}
            assert {"echo", "write_note", "search_notes"} <= names
            echoed = await c.call_tool("echo", {"text": "hi from the demo"})
            assert echoed.is_error is False
            assert echoed.structured_content == {"result": "hi from the demo"}
            refused = await c.call_tool("write_note", {"title": "creds", "body": "password: hunter2"})
            assert refused.is_error is True
            assert refused.content[0].text == "Blocked by policy (capability_blocked): notes must not contain credentials"
            assert refused.meta["envelope/decision"]["rule"] == "no-credentials"

    try:
        wait_port(admin, proc)
        wait_port(port, proc)
        deadline = time.monotonic() + 10
        while "metrics" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/mcp/" in text
        assert f"http://127.0.0.1:{admin}" in text
        assert f"http://127.0.0.1:{admin}/metrics" in text
        anyio.run(use_it)
        records = [line for line in (tmp_path / "state" / "audit" / "audit.jsonl").read_text().splitlines() if line]
        assert len(records) == 2
    finally:
        rc = stop(proc, signal.SIGINT)
    assert rc == 0, log.read_text()


def _occupied() -> tuple[socket.socket, int]:
    """A loopback port some other program is listening on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, int(holder.getsockname()[1])


def _assert_one_line_refusal(done: subprocess.CompletedProcess[str], port: int, setting: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "http://" not in done.stdout, done.stdout  # no URL of a proxy that never listened
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "address already in use" in lines[0]
    assert setting in lines[0]


def test_serve_on_a_busy_port_says_so_in_one_line(tmp_path: Path) -> None:
    holder, port = _occupied()
    with holder:
        done = cli("serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{port}",
                   "--admin", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "state"),
                   cwd=tmp_path, timeout=30)
    _assert_one_line_refusal(done, port, "--listen")


def _assert_one_line_start_failure(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "http://" not in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_serve_on_a_state_dir_another_proxy_writes_says_so_in_one_line(tmp_path: Path) -> None:
    # A demo left running in another terminal holds ./.envelope-state's audit log.
    audit = tmp_path / "state" / "audit"
    audit.mkdir(parents=True)
    with open(audit / "audit.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = cli("serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{free_port()}",
                   "--admin", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path / "state"),
                   cwd=tmp_path, timeout=30)
    _assert_one_line_start_failure(done, str(audit / "audit.jsonl"), "another process is writing")


def test_serve_with_a_missing_identity_key_file_says_so_in_one_line(tmp_path: Path) -> None:
    # The README's production config names a key file the machine may not have yet.
    config = tmp_path / "config.yaml"
    config.write_text("identity: {mode: jwt, algorithms: [RS256], key_file: /nonexistent/public.pem}\n")
    done = cli("serve", "--config", str(config), "--policies", str(FIXTURE_POLICIES),
               "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
               "--state-dir", str(tmp_path / "state"), cwd=tmp_path, timeout=30)
    _assert_one_line_start_failure(done, "identity key_file /nonexistent/public.pem")


@pytest.mark.parametrize(("yaml", "said"), [
    ('approvals: {approvers: {"alice\\u200b": {token_env: ALICE_TOKEN}}}\n',
     r"approvals.approvers: Value error, approver name 'alice\u200b' is not a usable id: it holds "
     "U+200B (a format character: zero-width, bidi or other invisible) at position 5"),
    ('approvals: {approvers: {"ops ": {token_env: OPS_TOKEN}, bob: {token_env: BOB_TOKEN}}}\n',
     "approvals.approvers: Value error, approver name 'ops ' is not a usable id: it has whitespace"),
    ('identity: {mode: static, principal: "agent\\u202e"}\n',
     r"identity: Value error, identity.principal 'agent\u202e' is not a usable id: it holds U+202E"),
], ids=["approver zero-width", "approver trailing space", "static principal bidi"])
def test_serve_with_a_name_that_is_not_an_id_does_not_start(tmp_path: Path, yaml: str, said: str) -> None:
    # An approver `alice\u200b` reads as alice on every record and page that names them.
    config = tmp_path / "config.yaml"
    config.write_text(yaml)
    done = cli("serve", "--config", str(config), "--policies", str(FIXTURE_POLICIES),
               "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
               "--state-dir", str(tmp_path / "state"), cwd=tmp_path, timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "http://" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert said in done.stderr, done.stderr
    assert done.stderr.isascii()  # the name escaped, never written raw


def test_demo_on_a_busy_admin_port_says_so_in_one_line(tmp_path: Path) -> None:
    holder, port = _occupied()
    with holder:
        done = cli("demo", "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{port}",
                   "--state-dir", str(tmp_path / "state"), timeout=60)
    _assert_one_line_refusal(done, port, "--admin")


def test_demo_probes_only_what_it_runs(tmp_path: Path) -> None:
    # The pack's placeholder upstreams (github, slack, ...) run nowhere: the demo must not warn
    # that they are down, while the server it does run is probed and up.
    port, admin = free_port(), free_port()
    log = tmp_path / "demo.log"
    env = {**os.environ, "ENVELOPE_HEALTH_INTERVAL": "0.2"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*CLI, "demo", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
             "--state-dir", str(tmp_path / "state")],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )
    try:
        wait_port(admin, proc)
        deadline = time.monotonic() + 10
        upstreams: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            upstreams = httpx.get(f"http://127.0.0.1:{admin}/readyz", timeout=5).json()["upstreams"]
            if upstreams.get("demo", {}).get("state") == "up":  # no traffic: only a probe says so
                break
            time.sleep(0.1)
        time.sleep(1.0)  # several more probe rounds: a placeholder probed would be down by now
        upstreams = httpx.get(f"http://127.0.0.1:{admin}/readyz", timeout=5).json()["upstreams"]
    finally:
        rc = stop(proc, signal.SIGINT)
    text = log.read_text()
    assert rc == 0, text
    assert upstreams["demo"]["state"] == "up", upstreams
    placeholders = sorted(set(upstreams) - {"demo"})
    assert placeholders, upstreams  # the whole pack is loaded
    assert all(upstreams[name]["state"] == "unknown" for name in placeholders), upstreams
    assert "is down" not in text, text
    assert f"placeholders, not probed: {', '.join(placeholders)}" in text


def test_check_reports_weak_spots_without_failing(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("""\
version: 1
upstreams:
  notes: {url: "http://127.0.0.1:1/mcp"}
defaults:
  gated_effects: [external]
tools:
  notes.delete_note: {effect: destructive}
  notes.write_note: {effect: write}
dataflow:
  declassify: {notes.write_note: true}
""")
    done = cli("check", "--strict", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr  # a weak spot is a choice, not an error
    spots = [line for line in done.stdout.splitlines() if line.startswith("weak spot: ")]
    assert spots == [
        "weak spot: defaults.gated_effects [ungated_destructive]: destructive is not in "
        "defaults.gated_effects: destructive tools without an approval block run without a "
        "person's approval",
        "weak spot: dataflow.declassify.notes.write_note [all_declassified]: every argument of "
        "sink 'notes.write_note' is declassified: untrusted text reaches it unflagged (only "
        "distinctive tokens still flag)",
    ]


def test_a_worker_that_cannot_start_stops_the_whole_process(tmp_path: Path) -> None:
    # Worker i serves its admin listener on the admin port + i. When worker 1's is taken, the
    # process must not go on serving with one worker while looking healthy: it stops worker 0
    # and exits non-zero, naming the address.
    admin = admin_ports(2)  # admin and admin + 1 both free, so only the holder below takes one
    taken = admin + 1
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        done = cli("serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{free_port()}",
                   "--admin", f"127.0.0.1:{admin}", "--workers", "2",
                   "--state-dir", str(tmp_path / "state"), cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"127.0.0.1:{taken}: address already in use" in done.stderr, done.stderr
    assert "worker 1 exited with 2; stopping the other workers" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_worker_killed_stops_the_whole_process_with_its_status(tmp_path: Path) -> None:
    # A crash (here SIGKILL) of one worker is a failure too: the others stop and the process
    # exits 128 + 9, not 0 because the survivors shut down cleanly.
    admin, listen = admin_ports(2), free_port()
    proc = subprocess.Popen([*CLI, "serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{listen}",
                             "--admin", f"127.0.0.1:{admin}", "--workers", "2",
                             "--state-dir", str(tmp_path / "state")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_port(admin + 1, proc)  # worker 1 serves its admin listener: both are up
        worker = _listener_pid(admin + 1)
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        stop(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "worker 1 exited with -9; stopping the other workers" in err, err


def test_a_second_proxy_with_workers_cannot_share_a_served_port(tmp_path: Path) -> None:
    # Workers bind the MCP port with SO_REUSEPORT, which the kernel grants to every process of
    # the same user that asks: a second `serve --workers 2` on the same listen address (its own
    # admin port and state) bound too, and connections were split between two proxies with
    # their own policy, store and audit log. It must fail as a single process does.
    listen = free_port()
    first = subprocess.Popen([*CLI, "serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{listen}",
                              "--admin", f"127.0.0.1:{admin_ports(2)}", "--workers", "2",
                              "--state-dir", str(tmp_path / "first")],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(listen, first)
        second = cli("serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{listen}",
                     "--admin", f"127.0.0.1:{admin_ports(2)}", "--workers", "2",
                     "--state-dir", str(tmp_path / "second"), cwd=tmp_path, timeout=60)
        assert first.poll() is None  # the first one serves on
    finally:
        stop(first)
    assert second.returncode == 2, second.stdout + second.stderr
    assert (f"the MCP listener cannot listen on 127.0.0.1:{listen}: address already in use; "
            "choose another address with --listen") in second.stderr, second.stderr
    assert "ready" not in second.stdout, second.stdout  # it never served


def test_workers_on_port_0_share_the_one_port_announced(tmp_path: Path) -> None:
    # `--listen HOST:0` (a free port) with workers: each worker bound a free port of its own,
    # the banner named worker 0's, and worker 1 served on a port nobody was told.
    admin = admin_ports(2)
    proc = subprocess.Popen([*CLI, "serve", "--policies", str(FIXTURE_POLICIES), "--listen", "127.0.0.1:0",
                             "--admin", f"127.0.0.1:{admin}", "--workers", "2",
                             "--state-dir", str(tmp_path / "state")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_port(admin, proc)
        wait_port(admin + 1, proc)  # both workers are up
        assert proc.stdout is not None
        banner = "".join(proc.stdout.readline() for _ in range(2))
        port = int(re.search(r"MCP +http://127\.0\.0\.1:(\d+)/", banner).group(1))  # type: ignore[union-attr]
        workers = {_listener_pid(admin), _listener_pid(admin + 1)}
        serving = [pid for pid in workers if port in _listening_ports(pid)]
    finally:
        stop(proc)
    assert sorted(serving) == sorted(workers), (banner, port)


def _listening_ports(pid: int) -> set[int]:
    """The loopback TCP ports process `pid` listens on (from /proc/net/tcp and its fd links)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _listener_pid(port: int) -> int:
    """The pid of the process listening on loopback `port` (from /proc/net/tcp and fd links)."""
    inode = ""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            inode = fields[9]
    assert inode, f"nothing listens on {port}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if f"socket:[{inode}]" in links:
            return int(pid)
    raise AssertionError(f"no process holds the socket of port {port}")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"  # gone while reading


def _two_workers(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int], int]:
    """`serve --workers 2` started and both workers up: (process, worker pids, admin port)."""
    admin, listen = admin_ports(2), free_port()
    proc = subprocess.Popen([*CLI, "serve", "--policies", str(FIXTURE_POLICIES), "--listen", f"127.0.0.1:{listen}",
                             "--admin", f"127.0.0.1:{admin}", "--workers", "2",
                             "--state-dir", str(tmp_path / "state")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_port(admin, proc)
    wait_port(admin + 1, proc)  # both workers are up
    workers = [_listener_pid(admin), _listener_pid(admin + 1)]
    assert sorted(workers) == sorted(w for w in _children(proc.pid) if w in workers)
    return proc, workers, admin


def test_sigterm_to_the_supervisor_drains_every_worker_and_exits_0(tmp_path: Path) -> None:
    # An orchestrator stops `serve --workers N` by signalling its main process. The workers must
    # shut down with it (gracefully: exit 0), not be left serving, orphaned.
    proc, workers, _ = _two_workers(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert _gone(workers, 10), [(w, _state(w)) for w in workers]
    assert err.count("shutdown complete") == 2, err  # each worker drained and closed its audit log
    for worker in (0, 1):  # and each says it was itself, in one container log
        assert re.search(rf"INFO envelope \[worker {worker}\]: shutdown complete", err), err
    assert "second signal" not in err, err


def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    # SIGKILL leaves the supervisor no chance to forward anything: the kernel tells each worker
    # (SIGTERM on its parent's death), and each shuts down instead of serving on unsupervised.
    proc, workers, _ = _two_workers(tmp_path)
    try:
        proc.kill()
        proc.wait(10)
        assert _gone(workers, 30), [(w, _state(w)) for w in workers]
    finally:
        stop(proc)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def test_sighup_to_the_supervisor_reloads_every_worker(tmp_path: Path) -> None:
    # SIGHUP reloads the policy (README); sent to `serve --workers 2` it must reach each worker,
    # not end the supervisor (the default action of SIGHUP).
    proc, workers, admin = _two_workers(tmp_path)

    def reloaded(port: int) -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return 'envelope_policy_reloads_total{result="success"} 1.0' in text

    try:
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not (reloaded(admin) and reloaded(admin + 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reloaded(admin) and reloaded(admin + 1)
        assert proc.poll() is None and all(Path(f"/proc/{w}").exists() for w in workers)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert err.count("(SIGHUP,") == 2, err  # "policy revision ... loaded (SIGHUP, N tools)" per worker
