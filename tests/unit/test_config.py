"""Runtime config durations: every duration field takes the one `Duration` type, so each accepts
`250ms`, `30s` and plain numbers, refuses words and negative values, and the error names the
file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.config import Config, cel_engine_setting, load_config
from proxy.errors import ConfigError
from tests.duration_fields import duration_fields

# Every duration field of the config; the walk below must find exactly these.
CONFIG_DURATIONS = [
    ("audit", "rotate_interval"),
    ("audit", "anchor_interval"),
    ("approvals", "ttl"),
    ("approvals", "poll_interval"),
    ("approvals", "retention"),
    ("approvals", "max_grant_duration"),
    ("approvals", "webhook", "timeout"),
    ("approvals", "webhook", "backoff"),
    ("approvals", "in_band_state_ttl"),
    ("idempotency", "ttl"),
    ("idempotency", "wait"),
    ("retry", "backoff"),
    ("retry", "max_backoff"),
    ("limits", "guardrail_scan_timeout"),
    ("listener", "header_timeout"),
    ("listener", "keepalive_timeout"),
    ("upstreams", "*", "idle_timeout"),
]
# "*" in a path: this dict key, in a file whose entry is otherwise valid.
KEYS = {"upstreams": ("demo", {"command": ["server"]})}


def test_every_duration_field_is_listed() -> None:
    assert sorted(duration_fields(Config)) == sorted(CONFIG_DURATIONS)


def _config_file(tmp_path: Path, path: tuple[str, ...], value: Any) -> Path:
    data: dict[str, Any] = {"approvals": {"webhook": {"url": "http://127.0.0.1:9/hook"}}}
    node = data
    for i, key in enumerate(path[:-1]):
        if key == "*":
            name, entry = KEYS[path[i - 1]]
            node = node.setdefault(name, dict(entry))
        else:
            node = node.setdefault(key, {})
    node[path[-1]] = value
    file = tmp_path / "config.yaml"
    file.write_text(json.dumps(data))  # JSON is YAML
    return file


def _read(config: Config, path: tuple[str, ...]) -> Any:
    node: Any = config
    for i, key in enumerate(path):
        node = node[KEYS[path[i - 1]][0]] if key == "*" else getattr(node, key)
    return node


@pytest.mark.parametrize("path", CONFIG_DURATIONS, ids=".".join)
@pytest.mark.parametrize(("value", "seconds"), [("250ms", 0.25), ("30s", 30.0), ("5m", 300.0),
                                                ("1h", 3600.0), (2, 2.0), (1.5, 1.5)])
def test_duration_field_accepts(tmp_path: Path, path: tuple[str, ...], value: Any,
                                seconds: float) -> None:
    config = load_config(_config_file(tmp_path, path, value), environ={})
    assert _read(config, path) == seconds


@pytest.mark.parametrize("path", CONFIG_DURATIONS, ids=".".join)
@pytest.mark.parametrize(("value", "message"), [
    ("soon", "not a duration: 'soon' (use e.g. 250ms, 30s, 5m)"),
    ("30", "not a duration: '30'"),
    (-1, "duration must not be negative"),
    (True, "not a duration: True"),
])
def test_duration_field_refuses_naming_the_field(tmp_path: Path, path: tuple[str, ...],
                                                  value: Any, message: str) -> None:
    file = _config_file(tmp_path, path, value)
    with pytest.raises(ConfigError) as info:
        load_config(file, environ={})
    shown = ".".join(KEYS[path[i - 1]][0] if k == "*" else k for i, k in enumerate(path))
    assert f"{file}: {shown}: Value error, {message}" in str(info.value)


def test_absent_durations_keep_their_defaults() -> None:
    config = load_config(None, environ={})
    assert config.audit.rotate_interval is None
    assert config.audit.anchor_interval == 60.0
    assert (config.approvals.ttl, config.approvals.poll_interval, config.approvals.retention,
            config.approvals.max_grant_duration, config.approvals.in_band_state_ttl) == (
        3600.0, 0.2, 86400.0, 86400.0, 600.0)
    assert (config.idempotency.ttl, config.idempotency.wait) == (86400.0, 30.0)
    assert (config.retry.backoff, config.retry.max_backoff) == (0.2, 5.0)
    assert (config.listener.header_timeout, config.listener.keepalive_timeout) == (10.0, 75.0)
    webhook = load_config(None, {"approvals": {"webhook": {"url": "http://h/x"}}}, environ={})
    assert webhook.approvals.webhook is not None
    assert (webhook.approvals.webhook.timeout, webhook.approvals.webhook.backoff) == (5.0, 0.5)


def test_rotate_interval_stays_positive_and_optional(tmp_path: Path) -> None:
    file = _config_file(tmp_path, ("audit", "rotate_interval"), "0s")
    with pytest.raises(ConfigError, match=r"audit\.rotate_interval: Input should be greater than 0"):
        load_config(file, environ={})
    assert load_config(_config_file(tmp_path, ("audit", "rotate_interval"), None),
                       environ={}).audit.rotate_interval is None


def test_anchor_interval_zero_turns_the_head_log_off(tmp_path: Path) -> None:
    file = _config_file(tmp_path, ("audit", "anchor_interval"), 0)
    assert load_config(file, environ={}).audit.anchor_interval == 0.0
    file = _config_file(tmp_path, ("audit", "anchor_interval"), None)
    with pytest.raises(ConfigError, match=r"audit\.anchor_interval: "):
        load_config(file, environ={})


def test_cel_engine_setting_has_the_precedence_of_load_config() -> None:
    env = {"ENVELOPE_CEL_ENGINE": "cel-python"}
    assert cel_engine_setting("cel-cpp", env) == "cel-cpp"  # the flag wins
    assert cel_engine_setting(None, env) == "cel-python"
    assert cel_engine_setting(None, {}) == "auto"
    assert cel_engine_setting(None, env) == load_config(None, environ=env).cel_engine
    assert load_config(None, {"cel_engine": "cel-cpp"}, environ=env).cel_engine == "cel-cpp"


def test_limits_default_and_refuse_nonsense(tmp_path: Path) -> None:
    limits = load_config(None, environ={}).limits
    assert (limits.max_upstream_event_bytes, limits.max_upstream_reply_bytes) == (32 * 2**20, 32 * 2**20)
    assert (limits.max_upstream_connections, limits.max_upstream_streams) == (256, 128)
    assert (limits.max_streams_per_principal, limits.max_streams_per_upstream) == (32, 128)
    file = _config_file(tmp_path, ("limits", "max_streams_per_principal"), 0)
    with pytest.raises(ConfigError, match=r"limits\.max_streams_per_principal: Input should be "
                                          r"greater than or equal to 1"):
        load_config(file, environ={})
    file = _config_file(tmp_path, ("listener", "header_timeout"), "0s")
    with pytest.raises(ConfigError, match=r"listener\.header_timeout: Input should be greater than 0"):
        load_config(file, environ={})


def test_listener_kind_is_a_name_or_a_mapping_and_the_environment_changes_only_the_kind(
        tmp_path: Path) -> None:
    assert load_config(None, environ={}).listener.kind == "fast"
    bare = tmp_path / "bare.yaml"
    bare.write_text("listener: fast\n")
    assert load_config(bare, environ={}).listener.model_dump() == {
        "kind": "fast", "header_timeout": 10.0, "keepalive_timeout": 75.0,
        "underscore_headers": "drop"}
    mapping = tmp_path / "mapping.yaml"
    mapping.write_text("listener: {header_timeout: 2s, keepalive_timeout: 5s}\n")
    merged = load_config(mapping, environ={"ENVELOPE_LISTENER": "fast"}).listener
    assert (merged.kind, merged.header_timeout, merged.keepalive_timeout) == ("fast", 2.0, 5.0)
    assert load_config(bare, environ={"ENVELOPE_LISTENER": "aiohttp"}).listener.kind == "aiohttp"
    with pytest.raises(ConfigError, match=r"listener\.kind: Input should be 'fast' or 'aiohttp'"):
        load_config(None, environ={"ENVELOPE_LISTENER": "nginx"})


def test_underscore_headers_is_one_of_three_actions(tmp_path: Path) -> None:
    file = _config_file(tmp_path, ("listener", "underscore_headers"), "reject")
    assert load_config(file, environ={}).listener.underscore_headers == "reject"
    file = _config_file(tmp_path, ("listener", "underscore_headers"), "strip")
    with pytest.raises(ConfigError, match=r"listener\.underscore_headers: Input should be 'drop', 'reject' or 'allow'"):
        load_config(file, environ={})


def test_the_listener_flag_sets_the_kind_and_keeps_the_files_timeouts(tmp_path: Path) -> None:
    file = tmp_path / "config.yaml"
    file.write_text("listener: {header_timeout: 3s}\n")
    listener = load_config(file, {"listener": "fast"}, environ={"ENVELOPE_LISTENER": "aiohttp"}).listener
    assert (listener.kind, listener.header_timeout) == ("fast", 3.0)


@pytest.mark.parametrize(("name", "problem"), [
    ("alice\u200b", "it holds U+200B"), ("\u202ealice", "it holds U+202E"), ("alice ", "whitespace"),
    ("", "it is empty"), ("a" * 257, "it has 257 characters"),
])
def test_an_approver_name_that_is_not_a_principal_id_is_refused(name: str, problem: str) -> None:
    # The self-approval rule compares approvers' names with principals: held to the same rule.
    approvers = {"bob": {"token_env": "BOB"}, name: {"token_env": "X"}}
    with pytest.raises(ConfigError, match=r"approvals\.approvers: Value error, approver name '") as refused:
        load_config(None, {"approvals": {"approvers": approvers}}, environ={})
    assert problem in str(refused.value) and str(refused.value).isascii()


def test_approver_names_people_write_are_taken() -> None:
    names = ["alice", "Alice Smith", "jos\u00e9@example.com", "\u5c71\u7530"]
    config = load_config(None, {"approvals": {"approvers": {n: {"token_env": "X"} for n in names}}},
                         environ={})
    assert list(config.approvals.approvers) == names
