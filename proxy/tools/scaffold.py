"""`envelope-proxy scaffold`: a starting policy and its tests from a live MCP server's tools.

Listing (`list_tools`, the official SDK client over Streamable HTTP or stdio) is separate from
deciding (`derive`: effect, gating and output labels from MCP annotations, minimal arguments from
the input schema) and from writing (`render_policy`, `render_tests`: ruamel round-trip documents,
so the "derived from annotations" comments survive and names are quoted where YAML would read
them as something else). The result is a draft an operator reviews: it is explicit (every effect
is written out, so the proxy never falls back to annotations for these tools) and it leans
closed (a tool with no annotations is a gated destructive writer, as the proxy would treat it).
"""

from __future__ import annotations

import io
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from proxy.errors import UpstreamError
from proxy.policy.model import TOOL_KEY
from proxy.policy.vocab import Effect

__all__ = ["ScaffoldTool", "derive", "example_value", "list_tools", "render_policy", "render_tests"]

# A server whose cursors never end would keep the command listing forever.
MAX_PAGES = 1000
# Values that satisfy the string formats the schema check asserts (proxy/policy/schemas.py).
FORMAT_EXAMPLES = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "idn-email": "user@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uri": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "iri-reference": "https://example.com/",
    "uri-template": "https://example.com/{id}",
    "json-pointer": "/x",
    "relative-json-pointer": "0",
    "regex": "x",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "duration": "P1D",
}
GATED: frozenset[Effect] = frozenset({Effect.EXTERNAL, Effect.DESTRUCTIVE})


@dataclass(frozen=True, slots=True)
class ScaffoldTool:
    """What the scaffold decides for one tool of the server."""

    name: str
    effect: Effect
    gated: bool
    output: Literal["trusted", "untrusted"]
    derivation: str  # the "derived from annotations: ..." comment text
    arguments: dict[str, Any]


async def list_tools(url: str | None = None, command: Sequence[str] = (), *, seconds: float = 30.0,
                     env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Every tool the server lists (all pages), as MCP JSON (camelCase keys).

    On any failure (unreachable, not MCP, a timeout, a cursor loop) raises `UpstreamError`
    naming the cause; nothing is written by the caller then."""
    import anyio
    from mcp import Client, StdioServerParameters

    target: str | StdioServerParameters
    if url is not None:
        target = url
    else:
        target = StdioServerParameters(command=command[0], args=list(command[1:]),
                                       env=dict(env) if env is not None else None)
    tools: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(seconds):
            async with Client(target, cache=None) as client:
                cursor: str | None = None
                seen: set[str] = set()
                for _ in range(MAX_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(t.model_dump(mode="json", by_alias=True, exclude_none=True)
                                 for t in page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        return tools
                    if cursor in seen:
                        raise UpstreamError(f"tools/list repeats the cursor {cursor!r}")
                    seen.add(cursor)
                raise UpstreamError(f"tools/list has more than {MAX_PAGES} pages")
    except UpstreamError:
        raise
    except TimeoutError as exc:
        raise UpstreamError(f"no complete tools/list within {seconds:g} s") from exc
    except Exception as exc:  # the SDK raises exception groups from its task groups
        raise UpstreamError(_first_cause(exc)) from exc


def _first_cause(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def derive(tool: Mapping[str, Any]) -> ScaffoldTool:
    """Effect, gating, output label and example arguments for one listed tool.

    MCP defaults apply to absent hints (readOnlyHint false, destructiveHint true,
    openWorldHint true), so a tool with no annotations is a gated destructive writer whose
    output is untrusted: the proxy's own safe default."""
    ann = tool.get("annotations") or {}
    read_only = ann.get("readOnlyHint") is True
    destructive = ann.get("destructiveHint") is not False
    open_world = ann.get("openWorldHint") is not False
    effect: Effect
    if read_only:
        effect = Effect.READ
    elif not destructive:
        effect = Effect.EXTERNAL if open_world else Effect.WRITE
    else:
        effect = Effect.DESTRUCTIVE
    hints = [f"{k}: {str(ann[k]).lower()}" for k in ("readOnlyHint", "destructiveHint", "openWorldHint")
             if isinstance(ann.get(k), bool)]
    derivation = "derived from annotations: " + (", ".join(hints) if hints else "none (MCP defaults)")
    schema = tool.get("inputSchema") or {}
    arguments = example_value(schema, schema) if isinstance(schema, Mapping) else {}
    return ScaffoldTool(
        name=str(tool["name"]), effect=effect, gated=effect in GATED,
        # Only a closed-world tool's output is trusted: anything from the open world may carry
        # prompt injections.
        output="trusted" if ann.get("openWorldHint") is False else "untrusted",
        derivation=derivation, arguments=arguments if isinstance(arguments, dict) else {},
    )


def example_value(schema: Any, root: Mapping[str, Any], depth: int = 0) -> Any:
    """A minimal value that satisfies `schema`: required properties only, enums and consts take
    their first value, numbers their lower bound (or 0), strings their format's example or
    enough "x" for minLength. Patterns are not solved (the value may not match one)."""
    if not isinstance(schema, Mapping) or depth > 32:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, Mapping) else None
        return example_value(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("allOf", "anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            # Prefer a branch that is not `null` (pydantic writes Optional[X] as anyOf [X, null]).
            chosen = next((b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")),
                          branches[0])
            return example_value(chosen, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema or "required" in schema else "string"
    if kind == "object":
        properties = schema.get("properties") or {}
        return {name: example_value(properties.get(name, {}), root, depth + 1)
                for name in schema.get("required") or [] if isinstance(name, str)}
    if kind == "array":
        count = schema.get("minItems") or 0
        item = example_value(schema.get("items", {}), root, depth + 1)
        return [item] * int(count)
    if kind in ("integer", "number"):
        return _number(schema, integer=kind == "integer")
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_EXAMPLES:
        return FORMAT_EXAMPLES[fmt]
    return "x" * max(int(schema.get("minLength") or 1), 1)


def _number(schema: Mapping[str, Any], integer: bool) -> int | float:
    low = schema.get("minimum")
    exclusive = schema.get("exclusiveMinimum")
    high = schema.get("maximum")
    value: float
    if isinstance(exclusive, (int, float)) and not isinstance(exclusive, bool):
        value = math.floor(exclusive) + 1 if integer else exclusive + 1
    elif isinstance(low, (int, float)) and not isinstance(low, bool):
        value = math.ceil(low) if integer else low
    elif isinstance(high, (int, float)) and not isinstance(high, bool) and high < 0:
        value = math.floor(high) if integer else high
    else:
        value = 0
    return int(value) if integer else value


def _yaml() -> YAML:
    yaml = YAML()  # round-trip: keeps the comments; quotes strings that would read as another type
    yaml.indent(mapping=2, sequence=4, offset=2)
    # Long flow mappings stay on one line: a wrapped `rule:` value reads as a broken case.
    yaml.width = 4096
    return yaml


def _dump(doc: CommentedMap) -> str:
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    return buf.getvalue()


def _flow(mapping: Mapping[str, Any]) -> CommentedMap:
    out = CommentedMap()
    for key, value in mapping.items():
        out[key] = _flow(value) if isinstance(value, Mapping) else _flow_seq(value) if isinstance(value, list) else value
    out.fa.set_flow_style()
    return out


def _flow_seq(items: list[Any]) -> CommentedSeq:
    out = CommentedSeq(_flow(v) if isinstance(v, Mapping) else _flow_seq(v) if isinstance(v, list) else v
                       for v in items)
    out.fa.set_flow_style()
    return out


def _comment_text(text: str) -> str:
    # A server's name or a command line must not end the comment and become YAML.
    return " ".join(text.split())


def valid_tools(name: str, tools: Sequence[ScaffoldTool]) -> tuple[list[ScaffoldTool], list[str]]:
    """The tools whose policy key is valid, and the names of those skipped (no key can name them)."""
    kept = [t for t in tools if TOOL_KEY.match(f"{name}.{t.name}")]
    return kept, [t.name for t in tools if t not in kept]


def render_policy(name: str, tools: Sequence[ScaffoldTool], *, url: str | None = None,
                  command: Sequence[str] = (), skipped: Sequence[str] = ()) -> str:
    """The policy file `NAME.yaml`: the upstream and every tool, explicit and commented."""
    doc = CommentedMap()
    source = url if url is not None else shlex.join(command)
    doc["version"] = 1
    upstream = CommentedMap()
    if url is not None:
        upstream["url"] = url
    else:
        # The proxy launches it itself (a stdio upstream); the command is a YAML list, so no
        # argument can become YAML of its own.
        argv = CommentedSeq(command)
        argv.fa.set_flow_style()
        upstream["command"] = argv
    upstreams = CommentedMap()
    upstreams[name] = upstream
    doc["upstreams"] = upstreams
    if url is None:
        doc.yaml_set_comment_before_after_key(
            "upstreams",
            before=_comment_text(f"Scaffolded from the stdio server `{source}`.") + "\n"
            "The proxy launches it (a process per client session, see \"Stdio servers\" in the\n"
            "README) with only PATH, HOME and LANG of its own environment: add what the server\n"
            "needs under `env:`.")
    table = CommentedMap()
    for tool in tools:
        entry = CommentedMap()
        entry["effect"] = tool.effect.value
        entry.yaml_add_eol_comment(tool.derivation, "effect")
        entry["output"] = tool.output
        if tool.gated:
            entry["approval"] = _flow({"required": True})
            entry.yaml_add_eol_comment(f"{tool.effect.value}: each call waits for an approver", "approval")
        table[f"{name}.{tool.name}"] = entry
    doc["tools"] = table
    header = [
        f"Policy for the MCP server {name}, scaffolded by `envelope-proxy scaffold`: review it before use.",
        _comment_text(f"Listed from: {source}"),
        "Effects come from the server's MCP annotations (readOnlyHint -> read; destructiveHint false",
        "-> write, or external when open-world; else destructive) and are written out, so policy,",
        "not the server, decides. external and destructive tools wait for approval; outputs are",
        "untrusted unless the tool is annotated closed-world (openWorldHint: false).",
    ]
    if skipped:
        header.append(_comment_text("Not listed (no policy key can name them; the proxy refuses them "
                                    "as unknown tools): " + ", ".join(repr(s) for s in skipped)))
    doc.yaml_set_start_comment("\n".join(header))
    return _dump(doc)


def render_tests(name: str, tools: Sequence[ScaffoldTool], principal: str = "agent") -> str:
    """The policy test file `tests/NAME.yaml`: one case per tool (allowed, or held for approval)."""
    cases = CommentedSeq()
    for tool in tools:
        key = f"{name}.{tool.name}"
        case = CommentedMap()
        if tool.gated:
            case["name"] = f"{key} waits for an approver ({tool.effect.value})"
            expect = {"verdict": "deny", "code": "approval_pending", "check": "approval",
                      "rule": f"tools.{key}.approval"}
        else:
            case["name"] = f"{key} is allowed ({tool.effect.value})"
            expect = {"verdict": "allow", "code": "ok"}
        case["principal"] = _flow({"id": principal})
        case["call"] = _flow({"tool": key, "arguments": tool.arguments})
        case["expect"] = _flow(expect)
        cases.append(case)
    doc = CommentedMap()
    doc["cases"] = cases
    doc.yaml_set_start_comment(
        f"Policy tests for {name}.yaml (scaffolded; run: envelope-proxy test <dir> -v).\n"
        "Arguments are minimal values for each tool's input schema; add the cases that matter.")
    return _dump(doc)
