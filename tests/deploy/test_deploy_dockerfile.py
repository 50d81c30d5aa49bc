"""deploy/Dockerfile, read statically (no Docker engine needed)."""

from __future__ import annotations

import json
import re
import tomllib

from deploy_helpers import DEPLOY, REPO

from proxy.config import ENV_KEYS, Config

DOCKERFILE = DEPLOY / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def _stages() -> list[tuple[str, list[tuple[str, str]]]]:
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for ins, args in _instructions():
        if ins == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", args, re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            stages.append((m.group(2), []))
        elif stages:
            stages[-1][1].append((ins, args))
    return stages


def _env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins, args in instructions:
        if ins == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = value
    return env


def test_multi_stage_on_python_slim() -> None:
    stages = _stages()
    assert [name for name, _ in stages] == ["builder", "runtime"]
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert text.count("FROM ${PYTHON_IMAGE} AS") == 2
    runtime = dict(stages)["runtime"]
    copies = [a for i, a in runtime if i == "COPY"]
    assert copies and all(a.startswith("--from=builder ") for a in copies), (
        "the runtime takes only the builder's venv, no sources")


def test_runtime_user_is_numeric_non_root() -> None:
    runtime = dict(_stages())["runtime"]
    users = [a for i, a in runtime if i == "USER"]
    assert users, "runtime stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) > 0), users[-1]


def test_env_read_only_root_and_listeners() -> None:
    env = _env(dict(_stages())["runtime"])
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["ENVELOPE_STATE_DIR"] == "/var/lib/envelope"
    assert env["ENVELOPE_POLICIES"] == "/policies"
    for key in env:
        if key.startswith("ENVELOPE_"):
            assert key in ENV_KEYS, f"{key} is not read by proxy.config"
    listen, admin = env["ENVELOPE_LISTEN"], env["ENVELOPE_ADMIN"]
    config = Config(listen=listen, admin=admin)
    assert config.listen_addr[0] == "0.0.0.0" and config.admin_addr[0] == "0.0.0.0"
    exposed = {int(p.split("/")[0]) for i, a in _stages()[-1][1] if i == "EXPOSE" for p in a.split()}
    assert exposed == {config.listen_addr[1], config.admin_addr[1]}


def test_healthcheck_and_entrypoint() -> None:
    runtime = _stages()[-1][1]
    checks = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert len(checks) == 1 and "/healthz" in checks[0] and "urllib.request" in checks[0]
    cmd = json.loads(checks[0][checks[0].index("CMD") + 3:].strip())
    assert cmd[:2] == ["python", "-c"]
    compile(cmd[2], "<healthcheck>", "exec")
    entry = [a for i, a in runtime if i == "ENTRYPOINT"]
    assert [json.loads(e) for e in entry] == [["envelope-proxy", "serve"]]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "envelope-proxy" in scripts


def test_no_remote_add_and_copy_sources_exist() -> None:
    stage_names = [name for name, _ in _stages()]
    for ins, args in _instructions():
        if ins == "ADD":
            assert not re.search(r"https?://|git@", args), f"ADD of a remote source: {args}"
        if ins not in ("COPY", "ADD"):
            continue
        parts = [p for p in args.split() if not p.startswith("--chown") and not p.startswith("--chmod")]
        if parts[0].startswith("--from="):
            assert parts[0].removeprefix("--from=") in stage_names
            continue
        *sources, _dest = parts
        for src in sources:
            assert (REPO / src).exists(), f"COPY source {src} missing from the build context"


def test_dockerignore_keeps_copy_sources() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "proxy/"):
        assert f"!{needed}" in ignore
