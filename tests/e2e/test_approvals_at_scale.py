"""Approvals and grants at scale, through the real proxy process on each store (SQLite, and a
real redis-server): the pending list reads each approval's record with its stored preview, never
its 1 MiB of arguments; a grant is found by the index of what a call matches on, also when the
store holds thousands (the matching one created last); records written by the previous version
(arguments inside the approval, grants without an index entry) still list, decide and release.

What the proxy read from Redis while answering is what the server sent (`total_net_output_bytes`);
on both stores the approval's record itself is read back and must be small."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from e2e_helpers import upstream_server, write_doc

from proxy.approvals.records import NS_APPROVAL, NS_GRANT, Approval, Grant
from proxy.approvals.service import NS_PENDING, ApprovalService
from proxy.store.base import Store
from proxy.store.redis import RedisStore
from proxy.store.sqlite import SqliteStore
from tests.harness import ProxyProcess, mcp_client, proxy_process, token
from tests.redis_server import RedisServer, running_redis

OPS = token("ops", tenant="acme")
ALICE_TOKEN = "alice-approver-token"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
MIB = 2**20
# Grants already in the store when the matching one is given: this many for the same principal
# and tool (other argument values), and as many again for other principals.
SAME_TOOL = 1000
OTHERS = 1000
PRINCIPAL = "ops"  # what the proxy names OPS's calls (checked on the first approval)


@dataclass
class World:
    kind: str
    proxy: ProxyProcess
    db: Path | None
    redis: RedisServer | None

    @contextlib.asynccontextmanager
    async def store(self) -> AsyncIterator[Store]:
        """The proxy's store, opened in the test process (on this test's event loop)."""
        store: Store = (SqliteStore(self.db, timeout=5.0) if self.db is not None
                        else RedisStore(self.redis.url, prefix="envelope:", timeout=5.0)  # type: ignore[union-attr]
                        )
        try:
            yield store
        finally:
            await store.close()

    def redis_sent(self) -> int:
        """The bytes Redis has sent its clients so far (0 on SQLite: its reads are the file's,
        mostly from its own page cache, which no counter outside it sees)."""
        if self.redis is None:
            return 0
        return int(redis.Redis.from_url(self.redis.url).info("stats")["total_net_output_bytes"])


def _policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {u: {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"} for u in ("notes", "gated")},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "notes.delete_note": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
            "notes.write_note": {"effect": "write"},
            "gated.write_note": {"effect": "external", "approval": {"required": True, "wait": "0s"}},
        },
    })


def _legacy_grant(args: dict[str, Any]) -> Grant:
    now = time.time()
    return Grant(id=f"grt-legacy{hashlib.sha256(orjson.dumps(args)).hexdigest()[:8]}", scope="tool",
                 principal=PRINCIPAL, upstream="gated", tool="write_note", run=None, args=args,
                 approver="alice", reason="given by the previous version", approval_id="apr-0000000000000000",
                 created_at=now, expires_at=now + 3600)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    kind: str = request.param
    tmp = tmp_path_factory.mktemp(f"scale-{kind}")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_redis(tmp)) if kind == "redis" else None
        db = None if server is not None else tmp / "shared.db"
        store_config = ({"kind": "redis", "url": server.url, "timeout": 5.0} if server is not None
                        else {"kind": "sqlite", "path": str(db), "timeout": 5.0})
        up = stack.enter_context(upstream_server("sse"))
        world = World(kind, None, db, server)  # type: ignore[arg-type]

        async def seed() -> None:  # a grant of the previous version: its record, no index entry
            async with world.store() as store:
                grant = _legacy_grant({"folder": "legacy"})
                await store.put(NS_GRANT, grant.id, grant.encode(), ttl=3600)

        asyncio.run(seed())
        config = {"store": store_config, "approvals": {"poll_interval": "100ms", "approvers": {
            "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}}}}
        world.proxy = stack.enter_context(proxy_process(
            tmp, {"notes": up.url, "gated": up.url}, policies=_policy(tmp / "policies"), config=config))
        yield world


async def call(world: World, upstream: str, tool: str, args: dict[str, Any]) -> Any:
    async with mcp_client(world.proxy.url(upstream), "auto", bearer=OPS) as c:
        return await c.call_tool(tool, args)


async def admin(world: World, method: str, path: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=world.proxy.admin, timeout=60, headers=ALICE) as http:
        return await http.request(method, path, **kw)


def refused_pending(result: Any) -> str:
    """The approval id of a call refused as pending (its decision's audit fields)."""
    assert result.is_error is True, result
    meta = dict((result.meta or {})["envelope/decision"])
    assert meta["code"] == "approval_pending", meta
    return str(meta["reason"]).split()[1]


async def test_the_pending_list_reads_previews_not_arguments(world: World) -> None:
    big = {"title": "big-" + "x" * MIB}
    size = len(json.dumps(big, separators=(",", ":")).encode())
    approval_id = refused_pending(await call(world, "notes", "delete_note", big))
    before = world.redis_sent()
    r = await admin(world, "GET", "/v1/approvals", params={"state": "pending"})
    read = world.redis_sent() - before
    assert r.status_code == 200, r.text
    [listed] = [a for a in r.json()["approvals"] if a["id"] == approval_id]
    assert listed["principal"] == PRINCIPAL
    assert (listed["arguments_truncated"], listed["arguments_bytes"], listed["arguments"]) == (True, size, None)
    assert listed["arguments_text"].startswith('{\n  "title": "big-xxx')
    assert "arguments_preview" not in listed
    # The list read the record and its preview, not the arguments (before: the whole 1 MiB,
    # which was the record).
    assert read < MIB // 4, read
    async with world.store() as store:
        record = await store.get(NS_APPROVAL, approval_id)
    assert record is not None and len(record) < 16 * 1024, len(record or b"")
    # Read by id, and answered to the approval, it is whole; the call then goes ahead once.
    whole = (await admin(world, "GET", f"/v1/approvals/{approval_id}")).json()
    assert (whole["arguments"], whole["arguments_truncated"], whole["arguments_bytes"]) == (big, False, size)
    r = await admin(world, "POST", f"/v1/approvals/{approval_id}/approve", json={"reason": "ok"})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["arguments"]) == ("approved", big)
    await call(world, "notes", "write_note", {"title": big["title"], "body": "b"})
    done = await call(world, "notes", "delete_note", big)
    assert done.is_error is False and done.structured_content["existed"] is True
    again = (await admin(world, "GET", f"/v1/approvals/{approval_id}")).json()
    assert (again["state"], again["arguments"]) == ("consumed", big)


async def test_an_approval_written_by_the_previous_version_lists_and_is_decided(world: World) -> None:
    now = time.time()
    big = {"title": "old-" + "y" * MIB}
    old = Approval(id="apr-00000000000000aa", state="pending", principal=PRINCIPAL, run="r-old",
                   upstream="notes", tool="delete_note", args_digest="sha256:old", arguments=big,
                   effect="destructive", reason="gated", created_at=now, expires_at=now + 600)
    record = {k: v for k, v in asdict(old).items() if k not in ("arguments_bytes", "arguments_preview")}
    async with world.store() as store:  # as the previous version stored it: arguments inside
        await store.put(NS_APPROVAL, old.id, orjson.dumps(record, option=orjson.OPT_SORT_KEYS), ttl=3600)
        await store.hash_put(NS_PENDING, "index", {old.id.encode(): repr(old.expires_at).encode()})
    r = await admin(world, "GET", "/v1/approvals", params={"state": "pending"})
    [listed] = [a for a in r.json()["approvals"] if a["id"] == old.id]
    assert (listed["arguments_truncated"], listed["arguments"]) == (True, None)
    assert listed["arguments_bytes"] == len(orjson.dumps(big))
    assert listed["arguments_text"].startswith('{\n  "title": "old-yyy')
    assert (await admin(world, "GET", f"/v1/approvals/{old.id}")).json()["arguments"] == big
    r = await admin(world, "POST", f"/v1/approvals/{old.id}/deny", json={"reason": "old"})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["arguments"]) == ("denied", big)


async def test_a_grant_given_after_thousands_of_others_is_found(world: World) -> None:
    first = refused_pending(await call(world, "gated", "write_note",
                                       {"title": "s1", "body": "b", "folder": "last"}))
    async with world.store() as store:
        service = ApprovalService(store)
        now = time.time()

        def grant(i: int, principal: str, folder: str) -> Grant:
            return Grant(id=f"grt-{i:016x}", scope="tool", principal=principal, upstream="gated",
                         tool="write_note", run=None, args={"folder": folder}, approver="alice",
                         reason="seeded", approval_id="apr-0000000000000000", created_at=now,
                         expires_at=now + 3600)

        seeded = [grant(i, PRINCIPAL, f"f-{i}") for i in range(SAME_TOOL)]
        seeded += [grant(SAME_TOOL + i, f"someone-{i}", "last") for i in range(OTHERS)]
        for start in range(0, len(seeded), 100):
            await asyncio.gather(*(service.add_grant(g) for g in seeded[start:start + 100]))
    r = await admin(world, "POST", f"/v1/approvals/{first}/approve", json={
        "reason": "the last one", "grant": {"scope": "tool", "args": {"folder": "last"}, "duration": "30m"}})
    assert r.status_code == 200, r.text
    given = r.json()["grant"]["id"]
    released = await call(world, "gated", "write_note", {"title": "s2", "body": "b", "folder": "last"})
    assert released.is_error is False and released.structured_content["saved"] == "s2"
    rec = [r for r in world.proxy.audit_records() if r["tool"] == "write_note"][-1]
    assert rec["verdict"] == "allow" and rec["extra"]["grant_id"] == given
    # A folder no grant names still asks.
    refused_pending(await call(world, "gated", "write_note", {"title": "s3", "body": "b", "folder": "none"}))
    # The admin list reads the first 1,000 grant records and says there were more.
    listing = (await admin(world, "GET", "/v1/grants")).json()
    assert listing["truncated"] is True and len(listing["grants"]) == 1000


async def test_a_grant_written_by_the_previous_version_still_releases_calls(world: World) -> None:
    released = await call(world, "gated", "write_note", {"title": "l1", "body": "b", "folder": "legacy"})
    assert released.is_error is False, released
    rec = [r for r in world.proxy.audit_records() if r["tool"] == "write_note"][-1]
    assert rec["extra"]["grant_id"] == _legacy_grant({"folder": "legacy"}).id
