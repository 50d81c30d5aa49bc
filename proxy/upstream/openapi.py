"""OpenAPI documents as tool catalogues: an HTTP upstream's operations become tools.

An upstream with `openapi:` is a REST service, not an MCP server. `load_spec` reads its
OpenAPI 3.0.x or 3.1.x document (JSON or YAML, a file or an http(s) URL) into a `Spec`: one
`Operation` per method and path, named by its `operationId` (or a readable fallback such as
`get_pets_petId`), with an input schema built from its path, query and header parameters and
its JSON request body. The rest is the translation both fronts need:

- `request_for` turns a tool call's arguments into the HTTP request the executor sends
  (`/mcp/<upstream>` and the aggregate `/mcp`);
- `Spec.match` and `arguments_from` go the other way, a plain HTTP request to an operation and
  its arguments (`/http/<upstream>/...`), so the envelope sees the same `ToolCall` either way;
- `result_from` turns the HTTP response into an MCP tool result the envelope inspects.

What is supported is said plainly, and everything else is skipped with a `problems` entry
(`file:line:column: ...`) rather than guessed at: parameters `in` path, query and header with
their default styles (query `form`, exploded or not; path and header `simple`), JSON request
bodies, `$ref`s inside the document (a recursive schema is kept as `$defs`). Cookie parameters,
`content`-typed parameters and non-JSON request bodies are unsupported: an operation that
*needs* one (required) is skipped, an optional one is left out of the tool. The document's
`servers` are ignored: requests go to the upstream's configured `url` (the operator's address
for the service, which the spec's author does not choose).

The input schema's root forbids unknown properties, so an argument the spec does not declare
is a `schema` refusal rather than something silently dropped on the way to the service.

What is sent is what was decided: a string path parameter is constrained (in its schema, and
again in `request_for`) to one segment (no empty value, `.`/`..` piece or control character),
a header parameter to printable ASCII, and `Spec.request_for` refuses a request another
operation would serve. A document cannot expand without bound (YAML aliases, `$ref` fan-out),
and `decoded` undoes a content coding within the reply cap before anything is inspected.
"""

from __future__ import annotations

import copy
import json
import re
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import orjson
from ruamel.yaml.nodes import Node

from proxy.errors import EnvelopeError, ReplyTooLarge
from proxy.policy.vocab import Effect
from proxy.policy.yamlload import Converter, expanded_size, locate, parse_file, position

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# A spec (a file, or fetched from a URL) is read up to this size: a policy load must not
# swallow a stream.
MAX_SPEC_BYTES = 16 * 1024 * 1024
# Bounds on what a small document can expand into: values once YAML aliases are expanded, and
# schema nodes one operation's input schema inlines from `$ref`s (refs to refs, each used many
# times, grow exponentially). Past them the document is refused / the operation skipped.
MAX_SPEC_NODES = 2_000_000
MAX_SCHEMA_NODES = 100_000
FETCH_TIMEOUT = 10.0
# The MCP tool-name alphabet; an operationId outside it is rewritten (and reported).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_TEMPLATE_PART = re.compile(r"\{([^{}/]+)\}")
ERROR_BODY_CHARS = 500
# The result `_meta` key carrying the response headers the plain HTTP front relays (a list of
# [name, value]): they travel with the result so the envelope inspects them with the body.
RELAYED_HEADERS_META = "http/headers"
# A JSON response nested deeper than this is a text result: the ledger and the guardrails walk
# structured content only so deep (`envelope.inspect.MAX_DEPTH`), its text they read whole.
MAX_RESULT_DEPTH = 200


class SpecError(EnvelopeError, ValueError):
    """An OpenAPI document cannot be read or used; the message starts `file:line:column: `."""


class SpecUnreadable(SpecError):
    """The document could not be read at all (no file, fetch failed): the fault is where it is
    named (the policy's `openapi:`), not inside it."""


_PLACED = re.compile(r"^(.+?):(\d+):(\d+): (.*)$", re.DOTALL)


def placed(error: SpecError) -> tuple[str, int, int, str]:
    """(file, line, column, message) of a `SpecError`'s text (file "" when it names none)."""
    m = _PLACED.match(str(error))
    if m is None:
        return "", 1, 1, str(error)
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)


@dataclass(frozen=True, slots=True)
class Param:
    """One path, query or header parameter of an operation."""

    name: str
    location: Literal["path", "query", "header"]
    required: bool
    schema: Mapping[str, Any]
    line: int
    explode: bool = True  # query arrays only: `?a=1&a=2` (True) or `?a=1,2` (False)


@dataclass(frozen=True, slots=True)
class Operation:
    """One method on one path: a tool."""

    tool: str
    method: str
    path: str
    description: str
    params: tuple[Param, ...]
    body_schema: Mapping[str, Any] | None
    body_required: bool
    body_merged: bool
    input_schema: Mapping[str, Any]
    effect: Effect
    line: int

    def tool_definition(self) -> dict[str, Any]:
        """The MCP `Tool` object `tools/list` announces for this operation."""
        return {
            "name": self.tool,
            "description": self.description or f"{self.method} {self.path}",
            "inputSchema": copy.deepcopy(dict(self.input_schema)),
            "annotations": {
                "title": f"{self.method} {self.path}",
                "readOnlyHint": self.effect is Effect.READ,
                "destructiveHint": self.effect is Effect.DESTRUCTIVE,
                # RFC 9110's idempotent methods; a POST is never assumed idempotent.
                "idempotentHint": self.method in ("GET", "HEAD", "PUT", "DELETE", "OPTIONS"),
                "openWorldHint": True,
            },
        }


@dataclass(frozen=True, slots=True)
class Spec:
    """An HTTP upstream's operations, by tool name in document order."""

    source: str
    operations: Mapping[str, Operation]
    problems: tuple[str, ...] = ()
    # (literal segments, pattern, operation, path parameter names), most literal first.
    _routes: tuple[tuple[int, re.Pattern[str], Operation, tuple[str, ...]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        routes = sorted((_route(op) for op in self.operations.values()), key=lambda r: r[0], reverse=True)
        object.__setattr__(self, "_routes", tuple(routes))

    def match(self, method: str, path: str) -> tuple[Operation, dict[str, str]] | None:
        """The operation serving `method path` and its decoded path parameters, or None.

        `path` is relative to the upstream's mount, without the query. A literal segment wins
        over a template (`/pets/mine` before `/pets/{id}`), as OpenAPI says.
        """
        method = method.upper()
        for _, pattern, op, names in self._routes:
            if op.method != method:
                continue
            m = pattern.fullmatch(path)
            if m is None:
                continue
            # Strict: bytes that are not UTF-8 (`%ff`) raise ValueError rather than becoming
            # U+FFFD, a value the agent never sent.
            return op, {
                name: urllib.parse.unquote(m.group(f"p{i}"), errors="strict")
                for i, name in enumerate(names)
            }
        return None

    def request_for(self, op: Operation, arguments: Mapping[str, Any]) -> HttpCall:
        """`request_for(op, arguments)`, refused (ValueError) when the request it builds would
        be served by another operation: a path parameter equal to a sibling's literal segment
        (`getPet(id="mine")` is `GET /pets/mine`, which the service routes to `getMyPets`, as
        OpenAPI says it must) would run an operation the policy never decided on."""
        http = request_for(op, arguments)
        served = self.match(op.method, http.path.split("?", 1)[0])
        if served is None or served[0] is not op:
            other = served[0].tool if served is not None else "no operation"
            raise ValueError(f"{op.tool}: the request {op.method} {http.path} is served by {other}")
        return http


@dataclass(frozen=True, slots=True)
class HttpCall:
    """The HTTP request for one call, relative to the upstream's `url`."""

    method: str
    path: str  # "/pets/7?limit=2": percent-encoded, appended to the upstream's url
    headers: Mapping[str, str]
    body: bytes | None
    relay: bool = False  # True: the plain HTTP front wants the upstream's bytes back


# -- loading -------------------------------------------------------------------------------


def load_spec(source: str, base_dir: Path | None) -> Spec:
    """Read and index the OpenAPI document at `source` (a file relative to `base_dir`, or an
    http(s) URL). Raises `SpecError` when it cannot be read, parsed or is not OpenAPI 3.0/3.1;
    operations it cannot support are skipped and listed in `Spec.problems`."""
    text, name = _read(source, base_dir)
    return parse_spec(text, name)


def parse_spec(text: str, name: str, source: str | None = None) -> Spec:
    """`load_spec` on text already read; `name` is the file name used in messages."""
    try:
        doc = _Document.parse(text, name)
        return _Builder(doc, source or name).build()
    except RecursionError:
        # Nesting deeper than the interpreter's stack (a hostile document): refused, never a
        # crash of the policy load.
        raise SpecError(f"{name}:1:1: the OpenAPI document nests too deep") from None


def _read(source: str, base_dir: Path | None) -> tuple[str, str]:
    if source.startswith(("http://", "https://")):
        try:
            data = _fetch(source)
        except (OSError, ValueError) as exc:
            raise SpecUnreadable(f"{source}:1:1: cannot fetch the OpenAPI document: {exc}") from exc
        if len(data) > MAX_SPEC_BYTES:
            raise SpecUnreadable(f"{source}:1:1: OpenAPI document exceeds {MAX_SPEC_BYTES} bytes")
        return _decode(data, source), source
    path = Path(source)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # a huge file, or a device that never ends
    except OSError as exc:
        raise SpecUnreadable(f"{path}:1:1: cannot read the OpenAPI document: {exc.strerror or exc}") from exc
    if len(data) > MAX_SPEC_BYTES:
        raise SpecUnreadable(f"{path}:1:1: OpenAPI document exceeds {MAX_SPEC_BYTES} bytes")
    return _decode(data, str(path)), str(path)


def _fetch(url: str) -> bytes:
    """The document at `url`, at most MAX_SPEC_BYTES + 1 of it, whole within FETCH_TIMEOUT
    (checked between reads; each read waits at most FETCH_TIMEOUT): the socket timeout alone
    bounds each wait, so a server sending a byte now and then would hold the policy load, and
    the reload lock behind it, for as long as it likes. TimeoutError past it."""
    deadline = time.monotonic() + FETCH_TIMEOUT
    data = bytearray()
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as resp:
        while len(data) <= MAX_SPEC_BYTES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not complete within {FETCH_TIMEOUT:g}s")
            chunk = resp.read1(MAX_SPEC_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    return bytes(data)


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{name}:1:1: the OpenAPI document is not UTF-8") from exc


@dataclass(frozen=True, slots=True)
class _Document:
    name: str
    value: Mapping[str, Any]
    root: Node | None  # None when only JSON could parse it: lines are then unknown (1)

    @classmethod
    def parse(cls, text: str, name: str) -> _Document:
        yfile, problems = parse_file(name, text)
        if yfile is not None and yfile.root is not None:
            if _expanded_size(yfile.root) > MAX_SPEC_NODES:
                raise SpecError(f"{name}:1:1: the OpenAPI document expands past {MAX_SPEC_NODES} "
                                "values (YAML aliases): refused")
            value = Converter().value(yfile.root)
            root: Node | None = yfile.root
        else:
            # JSON that YAML rejects (a tab before a key, say) is still a fine document.
            try:
                value = json.loads(text)
            except ValueError:
                if problems:
                    raise SpecError(str(problems[0])) from None
                raise SpecError(f"{name}:1:1: the OpenAPI document is empty") from None
            root = None
        if not isinstance(value, dict):
            raise SpecError(f"{name}:1:1: an OpenAPI document is a mapping")
        return cls(name, value, root)

    def where(self, loc: Sequence[str | int]) -> tuple[int, int]:
        if self.root is None:
            return 1, 1
        return position(locate(self.root, list(loc)))

    def at(self, loc: Sequence[str | int], message: str) -> str:
        line, col = self.where(loc)
        return f"{self.name}:{line}:{col}: {message}"

    def resolve(self, ref: Any, loc: Sequence[str | int]) -> tuple[Any, list[str | int]]:
        """The value a local `$ref` points at and its place; SpecError for any other ref."""
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SpecError(self.at(loc, f"only local $refs ('#/...') are supported, not {ref!r}"))
        parts: list[str | int] = []
        node: Any = self.value
        for raw in ref[2:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
                parts.append(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                parts.append(int(part))
            else:
                raise SpecError(self.at(loc, f"$ref {ref!r} points at nothing"))
        return node, parts


def _expanded_size(root: Node) -> int:
    """How many values `root` becomes once its aliases are expanded (`yamlload.expanded_size`)."""
    return expanded_size(root, MAX_SPEC_NODES)


class _Skip(Exception):
    """This operation cannot be offered; the message says why (with its place)."""


class _Builder:
    def __init__(self, doc: _Document, source: str) -> None:
        self.doc = doc
        self.source = source
        self.problems: list[str] = []
        self.budget = MAX_SCHEMA_NODES  # `_schema` nodes left for the current operation
        self.where: list[str | int] = []  # the current operation's place
        version = doc.value.get("openapi")
        if not isinstance(version, str) or not re.match(r"^3\.[01]\.\d+", version):
            raise SpecError(doc.at(["openapi"], f"not an OpenAPI 3.0 or 3.1 document (openapi: {version!r})"))
        self.v30 = version.startswith("3.0")

    def build(self) -> Spec:
        paths = self.doc.value.get("paths")
        if paths is None:
            paths = {}
        if not isinstance(paths, dict):
            raise SpecError(self.doc.at(["paths"], "`paths` must be a mapping"))
        ops: dict[str, Operation] = {}
        for path, item in paths.items():
            loc: list[str | int] = ["paths", path]
            if not isinstance(path, str) or not path.startswith("/"):
                self.problems.append(self.doc.at(loc, f"path {path!r} does not start with '/': skipped"))
                continue
            try:
                item, loc = self._deref(item, loc)
            except SpecError as exc:
                self.problems.append(f"{exc}: path skipped")
                continue
            if not isinstance(item, dict):
                continue
            shared = item.get("parameters") or []
            for method in METHODS:
                if method not in item:
                    continue
                oloc = [*loc, method]
                try:
                    op = self._operation(path, method, item[method], oloc, shared, [*loc, "parameters"])
                except (_Skip, SpecError) as exc:
                    self.problems.append(f"{exc}: operation skipped")
                    continue
                if op.tool in ops:
                    self.problems.append(self.doc.at(oloc, f"duplicate tool name {op.tool!r}: operation skipped"))
                    continue
                ops[op.tool] = op
        return Spec(self.source, ops, tuple(self.problems))

    # -- one operation ---------------------------------------------------------------------

    def _operation(
        self, path: str, method: str, raw: Any, loc: list[str | int],
        shared: Any, shared_loc: list[str | int],
    ) -> Operation:
        if not isinstance(raw, dict):
            raise _Skip(self.doc.at(loc, "an operation is a mapping"))
        line = self.doc.where(loc)[0]
        self.budget, self.where = MAX_SCHEMA_NODES, loc
        tool = self._tool_name(raw.get("operationId"), method, path, loc)
        params = self._params(shared, shared_loc, raw.get("parameters") or [], [*loc, "parameters"])
        templated = set(_TEMPLATE_PART.findall(path))
        declared = {p.name for p in params if p.location == "path"}
        if templated - declared:
            missing = ", ".join(sorted(templated - declared))
            raise _Skip(self.doc.at(loc, f"path parameter(s) {missing} not declared"))
        body_schema, body_required = self._body(raw.get("requestBody"), [*loc, "requestBody"])
        defs: dict[str, Any] = {}
        properties: dict[str, Any] = {}
        required: list[str] = []
        for p in params:
            properties[p.name] = _sendable(p, self._schema(p.schema, defs))
            if p.required:
                required.append(p.name)
        merged = False
        body_for_input: dict[str, Any] | None = None
        if body_schema is not None:
            body_for_input = self._schema(body_schema, defs)
            props = body_for_input.get("properties")
            merged = (
                body_for_input.get("type") == "object"
                and isinstance(props, dict)
                and not (set(props) & set(properties))
                and "$ref" not in body_for_input
            )
            if merged:
                assert isinstance(props, dict)
                properties.update(props)
                if body_required:
                    required.extend(
                        r for r in body_for_input.get("required", []) if isinstance(r, str)
                    )
            elif "body" in properties:
                raise _Skip(self.doc.at(loc, "a parameter named 'body' clashes with the request body"))
            else:
                properties["body"] = body_for_input
                if body_required:
                    required.append("body")
        schema: dict[str, Any] = {
            "type": "object",
            "properties": properties,
            "additionalProperties": False,
        }
        if required:
            schema["required"] = list(dict.fromkeys(required))
        if defs:
            schema["$defs"] = defs
        summary = raw.get("summary") if isinstance(raw.get("summary"), str) else ""
        detail = raw.get("description") if isinstance(raw.get("description"), str) else ""
        description = "\n\n".join(x.strip() for x in (summary, detail) if x and x.strip())
        upper = method.upper()
        effect = (
            Effect.READ if upper in ("GET", "HEAD")
            else Effect.DESTRUCTIVE if upper == "DELETE"
            else Effect.WRITE
        )
        return Operation(
            tool=tool, method=upper, path=path, description=description, params=tuple(params),
            body_schema=body_for_input, body_required=body_required, body_merged=merged,
            input_schema=schema, effect=effect, line=line,
        )

    def _tool_name(self, op_id: Any, method: str, path: str, loc: list[str | int]) -> str:
        if isinstance(op_id, str) and _TOOL_NAME.match(op_id):
            return op_id
        if isinstance(op_id, str) and op_id:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", op_id).strip("_")[:128] or method
            self.problems.append(self.doc.at(
                [*loc, "operationId"], f"operationId {op_id!r} is not a valid tool name: named {name!r}"
            ))
            return name
        parts = [method] + [
            re.sub(r"[^A-Za-z0-9]+", "_", seg).strip("_") for seg in path.split("/") if seg
        ]
        return "_".join(p for p in parts if p)[:128]

    def _params(
        self, shared: Any, shared_loc: list[str | int], own: Any, own_loc: list[str | int]
    ) -> list[Param]:
        by_key: dict[tuple[str, str], Param] = {}
        for raw_list, base in ((shared, shared_loc), (own, own_loc)):
            if not isinstance(raw_list, list):
                raise _Skip(self.doc.at(base, "`parameters` must be a list"))
            for i, raw in enumerate(raw_list):
                p = self._param(raw, [*base, i])
                if p is not None:
                    by_key[(p.location, p.name.lower() if p.location == "header" else p.name)] = p
        return list(by_key.values())

    def _param(self, raw: Any, loc: list[str | int]) -> Param | None:
        raw, loc = self._deref(raw, loc)
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise _Skip(self.doc.at(loc, "a parameter needs a name"))
        name, where = raw["name"], raw.get("in")
        required = raw.get("required") is True or where == "path"
        why = ""
        if where not in ("path", "query", "header"):
            why = f"parameters in {where!r} are not supported"
        elif "content" in raw and "schema" not in raw:
            why = "parameters described by `content` are not supported"
        else:
            style = raw.get("style")
            default = "form" if where == "query" else "simple"
            if style is not None and style != default:
                why = f"parameter style {style!r} is not supported (only {default!r})"
        if why:
            message = self.doc.at(loc, f"{why} ({name!r})")
            if required:
                raise _Skip(message)
            self.problems.append(f"{message}: parameter left out")
            return None
        if where == "header" and name.lower() in ("accept", "content-type", "authorization"):
            # OpenAPI says these are ignored as parameters; the proxy owns them.
            return None
        given = raw.get("schema")
        schema: dict[str, Any] = dict(given) if isinstance(given, dict) else {}
        if isinstance(raw.get("description"), str) and "description" not in schema:
            schema["description"] = raw["description"]
        explode = raw.get("explode", where == "query")
        location = cast(Literal["path", "query", "header"], where)  # checked above
        return Param(
            name=name, location=location, required=required, schema=schema,
            line=self.doc.where(loc)[0], explode=bool(explode),
        )

    def _body(self, raw: Any, loc: list[str | int]) -> tuple[Mapping[str, Any] | None, bool]:
        if raw is None:
            return None, False
        raw, loc = self._deref(raw, loc)
        if not isinstance(raw, dict):
            raise _Skip(self.doc.at(loc, "requestBody must be a mapping"))
        required = raw.get("required") is True
        content = raw.get("content")
        if not isinstance(content, dict):
            content = {}
        for media, entry in content.items():
            base = str(media).split(";")[0].strip().lower()
            if base == "application/json" or base.endswith("+json"):
                schema = entry.get("schema") if isinstance(entry, dict) else None
                return (dict(schema) if isinstance(schema, dict) else {}), required
        message = self.doc.at(loc, "only application/json request bodies are supported")
        if required:
            raise _Skip(message)
        self.problems.append(f"{message}: body left out")
        return None, False

    def _deref(self, value: Any, loc: list[str | int]) -> tuple[Any, list[str | int]]:
        seen: set[str] = set()
        while isinstance(value, dict) and "$ref" in value:
            ref = value["$ref"]
            if ref in seen:
                raise SpecError(self.doc.at(loc, f"$ref {ref!r} refers to itself"))
            seen.add(ref)
            value, loc = self.doc.resolve(ref, [*loc, "$ref"])
        return value, loc

    # -- schemas ---------------------------------------------------------------------------

    def _schema(self, schema: Any, defs: dict[str, Any], stack: tuple[str, ...] = ()) -> Any:
        """`schema` with local `$ref`s inlined (a recursive one kept in `defs`) and OpenAPI 3.0
        dialect (`nullable`, boolean `exclusiveMinimum`) rewritten as JSON Schema 2020-12.
        Raises `_Skip` past `MAX_SCHEMA_NODES` nodes for the operation."""
        self.budget -= 1
        if self.budget < 0:
            raise _Skip(self.doc.at(self.where, f"the input schema expands past {MAX_SCHEMA_NODES} "
                                    "nodes ($refs)"))
        if isinstance(schema, list):
            return [self._schema(s, defs, stack) for s in schema]
        if not isinstance(schema, dict):
            return schema
        if isinstance(schema.get("$ref"), str):
            ref = schema["$ref"]
            key = _def_name(ref)
            if ref in stack:
                return {"$ref": f"#/$defs/{key}"}
            target, _ = self.doc.resolve(ref, ["$ref"])
            inlined = self._schema(target, defs, (*stack, ref))
            if isinstance(inlined, dict) and _refers(inlined, key) and key not in defs:
                defs[key] = {}  # placeholder first: the definition refers to itself
                defs[key] = self._schema(target, defs, (ref,))
            return inlined
        out: dict[str, Any] = {}
        for k, v in schema.items():
            if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                out[k] = {n: self._schema(s, defs, stack) for n, s in v.items()} if isinstance(v, dict) else v
            elif k in ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                       "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems"):
                out[k] = self._schema(v, defs, stack)
            elif k in ("allOf", "anyOf", "oneOf", "prefixItems"):
                out[k] = self._schema(v, defs, stack)
            elif k in ("example", "xml", "externalDocs", "discriminator") or k.startswith("x-"):
                continue  # OpenAPI annotations a JSON Schema validator does not know
            else:
                out[k] = v
        if self.v30:
            _from_30(out)
        return out


def _from_30(out: dict[str, Any]) -> None:
    nullable = out.pop("nullable", False)
    if nullable is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)


def _def_name(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", ref.rsplit("/", 1)[-1]) or "ref"


def _refers(schema: Any, key: str) -> bool:
    if isinstance(schema, dict):
        if schema.get("$ref") == f"#/$defs/{key}":
            return True
        return any(_refers(v, key) for v in schema.values())
    if isinstance(schema, list):
        return any(_refers(v, key) for v in schema)
    return False


def _route(op: Operation) -> tuple[int, re.Pattern[str], Operation, tuple[str, ...]]:
    names: list[str] = []
    literal = 0
    pattern = []
    for seg in op.path.split("/"):
        pos = 0
        out = ""
        for m in _TEMPLATE_PART.finditer(seg):
            out += re.escape(seg[pos:m.start()]) + f"(?P<p{len(names)}>[^/]+)"
            names.append(m.group(1))
            pos = m.end()
        if pos == 0:
            literal += 1
        out += re.escape(seg[pos:])
        pattern.append(out)
    return literal, re.compile("/".join(pattern)), op, tuple(names)


# -- calls ---------------------------------------------------------------------------------


def request_for(op: Operation, arguments: Mapping[str, Any]) -> HttpCall:
    """The HTTP request performing `op` with `arguments` (already validated against
    `op.input_schema`). Raises ValueError naming the parameter when a required one is absent."""
    path = op.path
    query: list[tuple[str, str]] = []
    headers: dict[str, str] = {}
    for p in op.params:
        if p.name not in arguments or arguments[p.name] is None:
            if p.required:
                raise ValueError(f"missing required {p.location} parameter {p.name!r}")
            continue
        value = arguments[p.name]
        if p.location == "path":
            path = path.replace("{" + p.name + "}", urllib.parse.quote(_segment(p.name, value), safe=""))
        elif p.location == "query":
            if isinstance(value, list) and p.explode:
                query.extend((p.name, _text(v)) for v in value)
            else:
                query.append((p.name, _text(value)))
        else:
            headers[p.name] = _field_value(p.name, _text(value))
    body: bytes | None = None
    if op.body_schema is not None:
        names = {p.name for p in op.params}
        payload: Any
        if op.body_merged:
            payload = {k: v for k, v in arguments.items() if k not in names}
            if not payload and not op.body_required:
                payload = None
        else:
            payload = arguments.get("body")
        if payload is not None:
            body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
    if query:
        path += "?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return HttpCall(method=op.method, path=path, headers=headers, body=body)


# A path parameter's value that would not stay the one segment the policy decided on: a dot
# segment is removed by URL normalisation (RFC 3986 5.2.4, in yarl and most servers), so
# `/items/..` is `/`, and a server that decodes `%2F` (or reads `\` as `/`) before routing
# sees `a/../../admin` as dot segments too; an empty one makes another path (`/items/`); a
# control character (NUL) is cut or rejected differently by each server.
_DOT_SEGMENTS = frozenset((".", ".."))
_SEPARATORS = re.compile(r"[/\\]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A header field value as RFC 9110 5.5 allows it, ASCII only: visible characters, space and tab
# (no CR/LF, which would split it into more headers; no bytes a server decodes its own way).
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e]*")


# The same rules as input-schema constraints, so the schema check refuses such a value (and
# says why) before anything is decided, on both fronts; `request_for` checks them again.
_UNSENDABLE: dict[str, dict[str, Any]] = {
    "path": {"minLength": 1, "not": {"pattern": r"(^|[/\\])\.{1,2}([/\\]|$)|[\x00-\x1f\x7f]"}},
    "header": {"not": {"pattern": r"[^\t\x20-\x7e]"}},
}


def _sendable(p: Param, schema: Any) -> Any:
    """`schema` of parameter `p` constrained to the strings `request_for` can send unchanged
    (a string-typed path or header parameter; other types cannot hold such a value)."""
    guard = _UNSENDABLE.get(p.location)
    if guard is None or not isinstance(schema, dict) or _type_of(schema) not in (None, "string"):
        return schema
    if set(guard) & set(schema) or "$ref" in schema:
        return {"allOf": [schema, guard]}
    return {**schema, **guard}


def _segment(name: str, value: Any) -> str:
    text = _text(value)
    if not text or _CONTROL.search(text) or _DOT_SEGMENTS & set(_SEPARATORS.split(text)):
        raise ValueError(f"path parameter {name!r}: {text!r} cannot be sent as one path segment")
    return text


def _field_value(name: str, text: str) -> str:
    if not _FIELD_VALUE.fullmatch(text):
        raise ValueError(f"header parameter {name!r}: only printable ASCII can be sent in a header")
    return text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if value is None:
        return ""
    return str(value)


def arguments_from(
    op: Operation, path_params: Mapping[str, str], query: Mapping[str, list[str]],
    headers: Mapping[str, str], body: Any | None,
) -> dict[str, Any]:
    """The tool arguments of a plain HTTP request to `op` (the inverse of `request_for`).

    Strings are coerced by their parameter's schema type (integer, number, boolean, arrays of
    those); a value that does not fit raises ValueError naming the parameter. Everything else
    (required parameters, ranges, formats) is the schema check's to refuse.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    args: dict[str, Any] = {}
    for p in op.params:
        if p.location == "path":
            if p.name in path_params:
                args[p.name] = _coerce(p, path_params[p.name])
        elif p.location == "header":
            if p.name.lower() in lowered:
                args[p.name] = _coerce(p, lowered[p.name.lower()])
        else:
            values = list(query.get(p.name, []))
            if not values:
                continue
            if _type_of(p.schema) == "array":
                items = values if p.explode else [s for v in values for s in v.split(",")]
                args[p.name] = _coerce_array(p, items)
            elif len(values) > 1:
                raise ValueError(f"query parameter {p.name!r} is given {len(values)} times")
            else:
                args[p.name] = _coerce(p, values[0])
    if op.body_schema is not None and body is not None:
        if op.body_merged:
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            clash = set(body) & {p.name for p in op.params}
            if clash:
                raise ValueError(f"body property {sorted(clash)[0]!r} clashes with a parameter")
            args.update(body)
        else:
            args["body"] = body
    elif body is not None:
        raise ValueError(f"{op.method} {op.path} takes no request body")
    return args


def _type_of(schema: Mapping[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t if isinstance(t, str) else None


def _coerce(p: Param, text: str) -> Any:
    if _type_of(p.schema) == "array":
        return _coerce_array(p, text.split(",") if text else [])
    return _scalar(p.name, p.schema, text)


def _coerce_array(p: Param, items: list[str]) -> list[Any]:
    item_schema = p.schema.get("items")
    item_schema = item_schema if isinstance(item_schema, Mapping) else {}
    return [_scalar(p.name, item_schema, s) for s in items]


def _scalar(name: str, schema: Mapping[str, Any], text: str) -> Any:
    kind = _type_of(schema)
    if kind == "integer":
        try:
            return int(text, 10)
        except ValueError:
            raise ValueError(f"parameter {name!r}: {text!r} is not an integer") from None
    if kind == "number":
        try:
            return int(text, 10)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"parameter {name!r}: {text!r} is not a number") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(f"parameter {name!r}: {text!r} is not a finite number")
        return number
    if kind == "boolean":
        if text in ("true", "false"):
            return text == "true"
        raise ValueError(f"parameter {name!r}: {text!r} is not true or false")
    return text


def decoded(body: bytes, content_encoding: str, limit: int, setting: str) -> bytes:
    """`body` without its `Content-Encoding`: identity as is, `gzip`/`deflate` decompressed (at
    most `limit` bytes, ReplyTooLarge past it: a small bomb must not become a large reply).

    Inspection must see the text the agent will read, and the proxy never asks for an encoding;
    a backend that sends one anyway is decoded here, and any other encoding (br, zstd, several
    in a row) raises ValueError: the call is refused, never relayed unread.
    """
    coding = content_encoding.strip().lower()
    if coding in ("", "identity") or not body:  # (a HEAD, 204 or 304 names a coding, sends nothing)
        return body
    if coding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif coding == "deflate":
        # RFC 9110 says zlib-wrapped; some servers send raw deflate: tell them apart by header.
        wbits = zlib.MAX_WBITS if body[:1] and body[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        raise ValueError(f"unsupported Content-Encoding {content_encoding[:40]!r}")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ValueError(f"a {coding} body that does not decode: {exc}") from exc
    if len(out) > limit or inflater.unconsumed_tail:
        raise ReplyTooLarge(limit, setting)
    if not inflater.eof:
        raise ValueError(f"a truncated {coding} body")
    return out


def result_from(status: int, content_type: str, body: bytes) -> dict[str, Any]:
    """The MCP tool result for an HTTP response: JSON as `structuredContent` (an object as is,
    anything else as `{"result": value}`) with its text, other bodies as text, and a status of
    400 or more as an `isError` result naming the status and the start of the body. A redirect
    (301, 302, 303, 307, 308) is never followed and is an error too: an empty success would tell the agent the
    operation ran; where it points is not said (another host's URL is not the agent's to read)."""
    text = _text_of(content_type, body)
    if status in _REDIRECTS:
        return {
            "content": [{"type": "text", "text": f"HTTP {status}: the service answered with a "
                                                  "redirect, which the proxy does not follow"}],
            "isError": True,
        }
    if status >= 400:
        return {
            "content": [{"type": "text", "text": f"HTTP {status}: {text[:ERROR_BODY_CHARS]}"}],
            "isError": True,
        }
    media = content_type.split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            # orjson: a body nested past its limit is a decode error, never a RecursionError
            # that would end the call unaudited; deeper than MAX_RESULT_DEPTH is text too.
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            value = _NOT_JSON
        if value is not _NOT_JSON and _deeper_than(value, MAX_RESULT_DEPTH):
            value = _NOT_JSON
        if value is not _NOT_JSON:
            structured = value if isinstance(value, dict) else {"result": value}
            # The text content is the body as it came (valid UTF-8: orjson parsed it), not a
            # re-serialisation of the value: no second pass over a large answer on the loop.
            return {
                "content": [{"type": "text", "text": text}],
                "structuredContent": structured,
            }
    if not body:
        return {"content": []}
    return {"content": [{"type": "text", "text": text}]}


def _text_of(content_type: str, body: bytes) -> str:
    """`body` as the text inspected: UTF-8 (a byte that is not, U+FFFD, in binary media only).
    ValueError (the call is refused) when a reader may read other text from the same bytes: a
    textual body (JSON, `text/*`, none named) that is not UTF-8, a `charset` under which the
    body reads differently (or which is not known), or a textual body (JSON, `text/*`, none
    named) in UTF-16 or UTF-32, which a JSON reader detects (RFC 4627 3; Python's `json`,
    httpx's `.json()`) and a text reader follows by its BOM, while inspected as UTF-8 its
    letters stand between NULs and no guardrail matches."""
    text = body.decode("utf-8", errors="replace")
    if not body:
        return text
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() != "charset":
            continue
        charset = value.strip().strip('"').strip().lower()
        if charset in ("utf-8", "utf8"):
            continue
        try:
            same = body.decode(charset) == text
        except (LookupError, ValueError, TypeError):
            same = False
        if not same:
            raise ValueError(f"a body in charset {charset[:40]!r}, which reads otherwise than "
                             "as UTF-8: only UTF-8 is read")
    textual = not media or media.startswith("text/") or media == "application/json" or media.endswith("+json")
    if textual and json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        raise ValueError("a body in UTF-16 or UTF-32: only UTF-8 is read")
    if textual and "\ufffd" in text and text != body.decode("utf-8", errors="ignore"):
        # Bytes that are not UTF-8 are U+FFFD here; a reader that drops them instead reads
        # what they split (`AKIA\xffIOSF...`: the key no guardrail matched).
        raise ValueError("a text body that is not UTF-8: only UTF-8 is read")
    return text


_NOT_JSON = object()
# The statuses that send the client elsewhere (RFC 9110 §15.4); a 304 Not Modified is not one.
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests containers more than `limit` deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in node)
    return False
