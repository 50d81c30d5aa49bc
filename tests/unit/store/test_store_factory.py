"""open_store maps config to a backend and contacts nothing while doing so."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import Config
from proxy.errors import ConfigError
from proxy.store.factory import open_store
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore, redact_url
from proxy.store.sqlite import SqliteStore


def test_memory() -> None:
    assert isinstance(open_store(Config.model_validate({"store": {"kind": "memory"}})), MemoryStore)


def test_sqlite_default_path_in_state_dir_opens_nothing(tmp_path: Path) -> None:
    store = open_store(Config.model_validate({"state_dir": str(tmp_path / "state"), "store": {"timeout": 0.7}}))
    assert isinstance(store, SqliteStore)
    assert store.path == tmp_path / "state" / "state.db"
    assert store.timeout == 0.7
    assert not (tmp_path / "state").exists()  # opened on first use


def test_sqlite_explicit_path(tmp_path: Path) -> None:
    store = open_store(Config.model_validate({"store": {"kind": "sqlite", "path": str(tmp_path / "x.db")}}))
    assert isinstance(store, SqliteStore) and store.path == tmp_path / "x.db"


def test_redis_needs_url() -> None:
    with pytest.raises(ConfigError, match=r"store\.url"):
        open_store(Config.model_validate({"store": {"kind": "redis"}}))


def test_redis_bad_url_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"store\.url"):
        open_store(Config.model_validate({"store": {"kind": "redis", "url": "http://nope"}}))


def test_redis_built_without_connecting() -> None:
    config = Config.model_validate(
        {"store": {"kind": "redis", "url": "redis://:pw@127.0.0.1:1/2", "prefix": "p:"}}
    )
    store = open_store(config)
    assert isinstance(store, RedisStore)
    assert store.prefix == "p:" and store.url == "redis://:***@127.0.0.1:1/2"


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user:secret@host:6380/1", "redis://user:***@host:6380/1"),
    ("rediss://:secret@[::1]/0", "rediss://:***@[::1]/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
])
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
