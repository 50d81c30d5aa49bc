"""Build the configured store."""

from __future__ import annotations

from proxy.config import Config
from proxy.errors import ConfigError, StoreError
from proxy.store.base import Store
from proxy.store.memory import MemoryStore


def open_store(config: Config) -> Store:
    """The store the config names. Raises ConfigError for an unusable store config.

    Nothing is opened or contacted here: sqlite opens its file and redis connects on first use,
    so an unreachable backend shows up as StoreError from the first call (`ping` for readiness).
    """
    kind = config.store.kind
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        from proxy.store.sqlite import SqliteStore

        return SqliteStore(config.store.path or config.state_dir / "state.db", timeout=config.store.timeout)
    if kind == "redis":
        if not config.store.url:
            raise ConfigError("store.kind redis needs store.url (redis://host:port/db)")
        from proxy.store.redis import RedisStore

        try:
            return RedisStore(config.store.url, prefix=config.store.prefix, timeout=config.store.timeout)
        except StoreError as exc:  # a URL redis-py cannot parse; nothing is contacted here
            raise ConfigError(f"store.url: {exc}") from exc
    raise ConfigError(f"unknown store kind {kind!r}")
