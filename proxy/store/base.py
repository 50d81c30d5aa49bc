"""State behind one interface: memory (tests), SQLite (embedded default), Redis (replicas).

The store is a small namespaced key-value store with expiry and compare-and-set: enough for
approvals, grants, idempotency records, shadow records and run flags, whose logic lives once
above it (never per backend). Values are bytes (the callers store JSON). Every method raises
`proxy.errors.StoreError` when the backend cannot answer: callers fail closed.

Namespaces in use: `approval`, `approval_by_call`, `grant`, `idem`, `shadow`, `run`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Store(ABC):
    """Namespaced bytes with optional expiry (seconds). Keys and namespaces are short strings."""

    #: "memory", "sqlite" or "redis" (metrics label, readiness reason)
    kind: str = "store"

    @abstractmethod
    async def get(self, ns: str, key: str) -> bytes | None:
        """The value, or None when absent or expired."""

    @abstractmethod
    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        """Set the value (replacing any), expiring after `ttl` seconds when given."""

    @abstractmethod
    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        """Set the value only when the key is absent (or expired). True when it was set."""

    @abstractmethod
    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        """Replace the value only when it currently equals `expected`. True when replaced."""

    @abstractmethod
    async def delete(self, ns: str, key: str) -> None:
        """Remove the key (no error when absent)."""

    @abstractmethod
    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        """Unexpired (key, value) pairs of a namespace, at most `limit`, in no set order."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise StoreError when the backend cannot serve (readiness)."""

    async def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections and files."""
