"""`envelope-proxy stdio` flags and config file -> the runtime config the stdio front runs."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.cli.stdio import NO_APPROVER, OUT_OF_BAND, stdio_config
from proxy.errors import ConfigError


def parse(*words: str) -> argparse.Namespace:
    return build_parser().parse_args(["stdio", *words])


def test_defaults_local_principal_loopback_no_admin(tmp_path: Path) -> None:
    config, admin = stdio_config(parse("--policies", str(tmp_path), "--name", "notes",
                                       "--url", "http://127.0.0.1:9/mcp"), environ={})
    assert config.listen == "127.0.0.1:0" and config.workers == 1
    assert (config.identity.mode, config.identity.principal) == ("static", "local")
    assert config.upstreams["notes"].url == "http://127.0.0.1:9/mcp"
    assert config.aggregate.enabled is False
    assert admin is False


def test_config_file_admin_and_static_principal(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"admin": "127.0.0.1:0", "identity": {"mode": "static", "principal": "dev",
                                                                     "groups": ["writers"]}}))
    config, admin = stdio_config(parse("--config", str(cfg)), environ={})
    assert admin is True
    assert (config.identity.principal, config.identity.groups) == ("dev", ["writers"])
    config, _ = stdio_config(parse("--config", str(cfg), "--principal", "alice"), environ={})
    assert (config.identity.principal, config.identity.groups) == ("alice", ["writers"])


def test_jwt_identity_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"identity": {"mode": "jwt", "algorithms": ["HS256"], "key": "k" * 32}}))
    with pytest.raises(ConfigError, match="identity mode jwt cannot serve a stdio client"):
        stdio_config(parse("--config", str(cfg)), environ={})


def test_url_and_command_together_are_refused() -> None:
    args = parse("--url", "http://127.0.0.1:9/mcp")
    args.command = ["python", "server.py"]  # what `proxy.cli.main` cuts off after `--`
    with pytest.raises(ConfigError, match="either --url URL or a server command"):
        stdio_config(args, environ={})


def test_name_defaults_to_server() -> None:
    assert parse().name == "server"


def test_principal_flag_replaces_a_jwt_identity(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"identity": {"mode": "jwt", "algorithms": ["HS256"], "key": "k" * 32}}))
    config, _ = stdio_config(parse("--config", str(cfg), "--principal", "bob"), environ={})
    assert (config.identity.mode, config.identity.principal) == ("static", "bob")


@pytest.mark.parametrize("principal", ["bob\u200b", "bob ", "b\u202eob", "b" * 300])
def test_a_principal_flag_that_is_not_an_id_is_a_configuration_error(
        tmp_path: Path, principal: str) -> None:
    with pytest.raises(ConfigError, match=r"^--principal '.*is not a usable id: it ") as refused:
        stdio_config(parse("--policies", str(tmp_path), "--principal", principal), environ={})
    assert str(refused.value).isascii() and str(refused.value).isprintable()


def test_server_command_gets_the_launch_environment_minus_envelope_settings(tmp_path: Path) -> None:
    args = parse("--policies", str(tmp_path), "--name", "files")
    args.command = ["npx", "-y", "server", "/data"]
    environ = {"PATH": "/bin", "GITHUB_TOKEN": "t", "ENVELOPE_STATE_DIR": str(tmp_path / "s")}
    config, _ = stdio_config(args, environ=environ)
    entry = config.upstreams["files"]
    assert entry.command == ["npx", "-y", "server", "/data"] and entry.url is None
    assert entry.env == {"PATH": "/bin", "GITHUB_TOKEN": "t"}
    assert entry.idle_timeout >= 365 * 86400  # the client's session is never reaped for idleness
    assert config.state_dir == tmp_path / "s"  # the setting itself still applies to the proxy


def test_pending_hint_names_what_this_process_offers(tmp_path: Path) -> None:
    config, _ = stdio_config(parse("--policies", str(tmp_path)), environ={})
    assert config.approvals.pending_hint == NO_APPROVER
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"admin": "127.0.0.1:0"}))
    config, _ = stdio_config(parse("--config", str(cfg)), environ={})
    assert config.approvals.pending_hint == OUT_OF_BAND
    cfg.write_text(json.dumps({"approvals": {"pending_hint": "ask Bob"}}))
    config, _ = stdio_config(parse("--config", str(cfg)), environ={})
    assert config.approvals.pending_hint == "ask Bob"


def test_readme_client_configuration_snippet_launches_stdio() -> None:
    """The README's `mcpServers` JSON is valid and its args are a valid `stdio` command line."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```json\n(.*?)```", readme, flags=re.S)
    [snippet] = [json.loads(b) for b in blocks if "mcpServers" in b and "envelope-proxy" in b]
    [(name, server)] = snippet["mcpServers"].items()
    assert server["command"].endswith("/envelope-proxy")
    words = list(server["args"])
    cut = words.index("--")
    args = build_parser().parse_args(words[:cut])
    assert args.handler.__name__ == "cmd_stdio" and args.name == name
    assert words[cut + 1:] == ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/home/me/data"]
