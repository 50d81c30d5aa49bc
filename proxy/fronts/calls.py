"""Ingress: the wire's view of a call turned into a `ToolCall`, the same way on every route.

`tool_call_from` is used by both MCP routes (`/mcp/<upstream>` and the aggregated `/mcp`): the
run, the session, the parent run and agent claims, the idempotency key, the shadow and
capability requests and the policy-selected headers are read from one place. `read_from` builds
the call a content read (`resources/read`, `prompts/get`, `tasks/result`) or a relayed stream
is audited and recorded as. Only headers and JSON-RPC messages are read here (no aiohttp
types), so any listener can feed it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall
from proxy.fronts import jsonrpc
from proxy.fronts.jsonrpc import BadMessage, Message

STATELESS_REVISION = "2026-07-28"
CLIENT_INFO_META = "io.modelcontextprotocol/clientInfo"
PROTOCOL_META = "io.modelcontextprotocol/protocolVersion"
IDEMPOTENCY_META = "envelope/idempotency_key"
TRUE = frozenset({"1", "true", "yes"})


def new_decision_id() -> str:
    """A random (version 4) UUID as 32 hex digits: what `uuid.uuid4().hex` returns, at a
    quarter of its cost (no `UUID` object, no int round trip): one is minted per call."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    return b.hex()


@dataclass(frozen=True, slots=True)
class Route:
    """Where a call goes and which session it belongs to, as the route sees it.

    `session` is the MCP session of the call (the client's `Mcp-Session-Id` on
    `/mcp/<upstream>`, the aggregate's own session id on `/mcp`); `protocol_version` the
    revision the client speaks.
    """

    upstream: str
    session: str | None
    protocol_version: str


def is_stateless(headers: Mapping[str, str], msg: Message | None) -> bool:
    """Whether a request speaks the stateless revision (2026-07-28 or later)."""
    version = headers.get("MCP-Protocol-Version", "")
    if not version and msg is not None:
        meta = msg.params.get("_meta")
        if isinstance(meta, dict):
            v = meta.get(PROTOCOL_META)
            version = v if isinstance(v, str) else ""
    return version >= STATELESS_REVISION


def idempotency_key(headers: Mapping[str, str], params: Mapping[str, Any]) -> str | None:
    """The client's idempotency key: the `Idempotency-Key` header, else
    `params._meta["envelope/idempotency_key"]`; bounded to 200 characters."""
    key = headers.get("Idempotency-Key")
    if not key:
        meta = params.get("_meta")
        value = meta.get(IDEMPOTENCY_META) if isinstance(meta, dict) else None
        key = value if isinstance(value, str) else None
    return key[:200] if key else None


def run_id(headers: Mapping[str, str], session: str | None, principal_id: str,
           params: Mapping[str, Any]) -> str:
    """The run a call belongs to: the `X-Envelope-Run` header, else the MCP session, else
    (stateless revision) the principal plus the client it runs in, as named by
    `_meta["io.modelcontextprotocol/clientInfo"]` (name and version). The stateless protocol
    carries no per-instance id, so two instances of one client program under one principal
    share a run: their histories merge, which widens data-flow verdicts, never narrows them.
    Frameworks that run several agents per principal send `X-Envelope-Run`."""
    explicit = headers.get("X-Envelope-Run")
    if explicit:
        return explicit
    if session:
        return session
    meta = params.get("_meta")
    info = meta.get(CLIENT_INFO_META) if isinstance(meta, Mapping) else None
    if isinstance(info, Mapping) and isinstance(info.get("name"), str) and info["name"]:
        version = info.get("version")
        client = f"{info['name']}@{version}" if isinstance(version, str) and version else info["name"]
        return f"principal:{principal_id}/client:{client[:200]}"
    return f"principal:{principal_id}"


def tool_request(msg: Message, headers: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The tool name and arguments of a `tools/call`; BadMessage (with the JSON-RPC error to
    send) when they are malformed or the `Mcp-Name` header disagrees with the body."""
    params = msg.params
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise BadMessage(jsonrpc.INVALID_PARAMS, 'Invalid params: "name" must be a non-empty string',
                         "invalid_request", id=msg.id)
    arguments = params.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadMessage(jsonrpc.INVALID_PARAMS, 'Invalid params: "arguments" must be an object',
                         "invalid_request", id=msg.id)
    header_name = headers.get("Mcp-Name")
    if header_name is not None and header_name != name:
        raise BadMessage(jsonrpc.HEADER_MISMATCH,
                         f"Mcp-Name header {header_name!r} does not match the tool name {name!r}",
                         "header_mismatch", id=msg.id)
    return name, arguments


def _run(headers: Mapping[str, str], route: Route, principal: Principal,
         params: Mapping[str, Any]) -> RunContext:
    # The parent run and agent are claims the delegation check resolves against the proxy's own
    # lineage records; the depth is never taken from the client.
    return RunContext(id=run_id(headers, route.session, principal.id, params), principal=principal.id,
                      session=route.session, parent=headers.get("X-Envelope-Parent-Run") or None,
                      agent=headers.get("X-Envelope-Agent") or None)


def tool_call_from(headers: Mapping[str, str], msg: Message, route: Route, tool: str,
                   arguments: dict[str, Any], principal: Principal,
                   selected: tuple[str, ...]) -> ToolCall:
    """The `ToolCall` of a `tools/call` on `route` (`tool` as the upstream names it), with the
    policy-selected request headers (`selected`) visible to CEL."""
    params = msg.params
    return ToolCall(
        decision_id=new_decision_id(),
        upstream=route.upstream,
        tool=tool,
        arguments=arguments,
        principal=principal,
        run=_run(headers, route, principal, params),
        request=RequestInfo(method="tools/call", protocol_version=route.protocol_version,
                            headers={h: headers[h] for h in selected if h in headers}),
        idempotency_key=idempotency_key(headers, params),
        shadow_requested=headers.get("X-Envelope-Shadow", "").strip().lower() in TRUE,
        capability_requested=_all_values(headers, "X-Envelope-Capability"),
        intent=headers.get("X-Envelope-Intent"),
    )


def _all_values(headers: Mapping[str, str], name: str) -> str | None:
    """Every value of a header given more than once, joined by commas (as HTTP folds them):
    a narrowing header any of whose values narrows must not be read from its first only."""
    getall = getattr(headers, "getall", None)
    if getall is None:
        return headers.get(name)
    values = getall(name, ())
    return ", ".join(values) if values else None


def read_from(headers: Mapping[str, str], method: str, params: Mapping[str, Any], route: Route,
              principal: Principal, tool: str | None = None) -> ToolCall:
    """The call a content read or a relayed stream is audited as: `method` (`resources/read`,
    `prompts/get`, `tasks/result`, or what a relayed stream carries), its params without
    `_meta` as arguments, and `tool` the original tool when a task's tool is known (else the
    method). Lineage claims are not taken: what a read delivers widens no parent run."""
    arguments = {k: v for k, v in params.items() if k != "_meta"}
    return ToolCall(
        decision_id=new_decision_id(),
        upstream=route.upstream,
        tool=tool or method,
        arguments=arguments,
        principal=principal,
        run=RunContext(id=run_id(headers, route.session, principal.id, params), principal=principal.id,
                       session=route.session, taint_targets=()),
        request=RequestInfo(method=method, protocol_version=route.protocol_version),
    )
