"""The CEL seam: one interface, two engines.

`cel-cpp` (PyPI `cel-expr-python`, Google's cel-cpp) is used wherever it has a wheel; the
pure-Python `cel-python` is the automatic fallback. Nothing outside this module imports either
library. Select with `ENVELOPE_CEL_ENGINE=auto|cel-cpp|cel-python` (default auto).

Contract: `Engine.compile(expr)` raises `CelCompileError` (with a 0-based offset where known);
`Engine.activation(vars)` converts the per-call variables once; `Program.evaluate(act)` returns a
bool or raises `CelEvalError` (runtime error or a non-bool result). Callers decide what an error
means (a forbid rule that errors counts as matched, an allow rule as not matched).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Protocol

from proxy.errors import CelCompileError, CelEvalError

# Variables visible to CEL, all maps of string to dyn except `now`.
VARIABLES = ("principal", "tool", "args", "run", "request", "now")


class Program(Protocol):
    source: str

    def evaluate(self, activation: Any) -> bool: ...


class Engine(Protocol):
    name: str

    def compile(self, expr: str) -> Program: ...

    def activation(self, variables: Mapping[str, Any]) -> Any: ...


_LOCATION = re.compile(r"<input>:(\d+):(\d+):")


def _offset(expr: str, message: str) -> int:
    """0-based offset in `expr` from an engine message naming `<input>:line:col`."""
    m = _LOCATION.search(message)
    if not m:
        return 0
    line, col = int(m.group(1)), int(m.group(2))
    lines = expr.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + max(col - 1, 0)


class _CppProgram:
    __slots__ = ("_expr", "source")

    def __init__(self, source: str, expr: Any):
        self.source = source
        self._expr = expr

    def evaluate(self, activation: Any) -> bool:
        try:
            value = self._expr.eval(activation)
        except Exception as exc:  # the binding raises on some conversion failures
            raise CelEvalError(str(exc)) from exc
        result = value.value()
        if result is True or result is False:
            return result
        raise CelEvalError(
            str(result) if value.type().name() == "ERROR" else f"not a bool: {result!r}"
        )


class CppEngine:
    """cel-cpp through cel-expr-python: parsed, type-checked and planned at compile time."""

    name = "cel-cpp"

    def __init__(self) -> None:
        from cel_expr_python import cel

        self._cel = cel
        dyn_map = cel.Type.Map(cel.Type.STRING, cel.Type.DYN)
        variables = {v: dyn_map for v in VARIABLES if v != "now"}
        variables["now"] = cel.Type.TIMESTAMP
        self._env = cel.NewEnv(variables=variables)

    def compile(self, expr: str) -> _CppProgram:
        try:
            compiled = self._env.compile(expr)
        except Exception as exc:
            message = str(exc)
            # "INVALID_ARGUMENT: ERROR: <input>:1:21: found no matching overload ...\n | ..."
            first = message.split("\n", 1)[0]
            first = re.sub(r"^[A-Z_]+: ERROR: <input>:\d+:\d+: ", "", first)
            raise CelCompileError(first, _offset(expr, message)) from exc
        rtype = compiled.return_type().name()
        if rtype not in ("BOOL", "DYN", "bool", "dyn"):
            raise CelCompileError(f"expression must be a bool, it is {rtype.lower()}", 0)
        return _CppProgram(expr, compiled)

    def activation(self, variables: Mapping[str, Any]) -> Any:
        return self._env.Activation(dict(variables))


class _PyProgram:
    __slots__ = ("_prog", "source")

    def __init__(self, source: str, prog: Any):
        self.source = source
        self._prog = prog

    def evaluate(self, activation: Any) -> bool:
        try:
            result = self._prog.evaluate(activation)
        except Exception as exc:
            raise CelEvalError(str(exc)) from exc
        if isinstance(result, bool) or type(result).__name__ == "BoolType":
            return bool(result)
        raise CelEvalError(f"not a bool: {result!r}")


def _py_syntax_error(expr: str, exc: Exception) -> tuple[str, int]:
    """(message, 0-based offset) of a cel-python parse error, worded like cel-cpp's."""
    line, column = getattr(exc, "line", None), getattr(exc, "column", None)
    offset = 0
    if isinstance(line, int) and isinstance(column, int) and line > 0 and column > 0:
        lines = expr.split("\n")
        offset = sum(len(x) + 1 for x in lines[: line - 1]) + column - 1
    # The lark error (the context) says what was unexpected; the exception text only echoes
    # the source line with a caret.
    detail = str(exc.__context__ or exc).strip().split("\n", 1)[0]
    detail = re.sub(r",? at line \d+,? col(umn)? \d+\.?$", "", detail)
    detail = re.sub(
        r"Token\('([^']*)', '((?:[^'\\]|\\.)*)'\)",
        lambda m: "<EOF>" if m.group(1) == "$END" else f"'{m.group(2)}'",
        detail,
    )
    return f"Syntax error: {detail or 'invalid expression'}", offset


class PyEngine:
    """cel-python: pure Python, ~100x slower; the fallback where cel-cpp has no wheel."""

    name = "cel-python"

    def __init__(self) -> None:
        import celpy

        self._celpy = celpy
        self._env = celpy.Environment()

    def compile(self, expr: str) -> _PyProgram:
        try:
            ast = self._env.compile(expr)
            prog = self._env.program(ast)
        except Exception as exc:
            raise CelCompileError(*_py_syntax_error(expr, exc)) from exc
        return _PyProgram(expr, prog)

    def activation(self, variables: Mapping[str, Any]) -> Any:
        from celpy import celtypes

        act: dict[str, Any] = {}
        for key, value in variables.items():
            if key == "now":
                act[key] = celtypes.TimestampType(value)
            else:
                act[key] = self._celpy.json_to_cel(value)
        return act


_ENGINES: dict[str, Engine] = {}


def available_engines() -> list[str]:
    """Engine names that can be built on this machine."""
    names = []
    for name in ("cel-cpp", "cel-python"):
        try:
            get_engine(name)
        except CelCompileError:
            continue
        names.append(name)
    return names


def get_engine(name: str | None = None) -> Engine:
    """The named engine (`auto`, `cel-cpp`, `cel-python`); auto prefers cel-cpp.

    Raises `CelCompileError` when the named engine is not installed.
    """
    name = (name or os.environ.get("ENVELOPE_CEL_ENGINE") or "auto").strip()
    if name == "auto":
        try:
            return get_engine("cel-cpp")
        except CelCompileError:
            return get_engine("cel-python")
    if name in _ENGINES:
        return _ENGINES[name]
    if name not in ("cel-cpp", "cel-python"):
        raise CelCompileError(f"unknown CEL engine {name!r} (auto, cel-cpp, cel-python)")
    try:
        engine: Engine = CppEngine() if name == "cel-cpp" else PyEngine()
    except ImportError as exc:
        raise CelCompileError(f"CEL engine {name} is not installed: {exc}") from exc
    _ENGINES[name] = engine
    return engine


# --- Static checks the engines do not do -----------------------------------------------------
#
# Every variable is declared as map(string, dyn), so cel-cpp cannot tell `principal.grups` from
# `principal.groups`; and cel-python checks nothing at all. These checks run on cel-python's
# parse tree (a syntactic parse, same for both engines) so both engines report the same problems.

# Fields of the fixed-shape variables; `args`, `principal.claims.*`, `tool.annotations.*` and
# `request.headers.*` are open.
FIELDS: dict[str, tuple[str, ...]] = {
    "principal": ("id", "groups", "claims"),
    "tool": ("name", "upstream", "effect", "annotations"),
    "run": ("id", "parent", "depth", "shadow", "tainted", "secret"),
    "request": ("method", "protocol_version", "headers"),
}
# Macros binding their first argument as a variable over the remaining arguments.
_BINDING_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
# Type identifiers CEL resolves by name (`type(x) == string`).
_TYPE_NAMES = frozenset(
    {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type", "dyn"}
)
_WRAPPERS = frozenset(
    {
        "expr",
        "conditionalor",
        "conditionaland",
        "relation",
        "addition",
        "multiplication",
        "unary",
        "member",
        "primary",
    }
)
_LITERAL_TYPES = {
    "INT_LIT": "int",
    "UINT_LIT": "uint",
    "FLOAT_LIT": "double",
    "STRING_LIT": "string",
    "MLSTRING_LIT": "string",
    "BYTES_LIT": "bytes",
    "NULL_LIT": "null_type",
}


def lint(expr: str, *, identifiers: bool = True, result_type: bool = True) -> list[tuple[int, str]]:
    """Problems the engines miss, as (0-based offset, message), in source order.

    Unknown fields on the fixed-shape variables always; with `identifiers`, references to
    undeclared variables (macro variables are bound, not undeclared); with `result_type`, a
    result that is obviously not a bool (a literal, arithmetic, a list or map). An expression
    that does not parse yields nothing here: the engine reports the syntax error.
    """
    from celpy.celparser import CELParser
    from lark import Token, Tree

    try:
        tree = CELParser().parse(expr)
    except Exception:
        return []
    problems: list[tuple[int, str]] = []

    def bare_ident(node: Any) -> Token | None:
        while isinstance(node, Tree) and len(node.children) == 1:
            if node.data == "ident":
                tok = node.children[0]
                return tok if isinstance(tok, Token) else None
            if node.data not in _WRAPPERS:
                return None
            node = node.children[0]
        return None

    def visit(node: Any, bound: frozenset[str]) -> None:
        if not isinstance(node, Tree):
            return
        if node.data == "member_dot_arg" and len(node.children) == 3:
            target, method, args = node.children
            visit(target, bound)
            exprs = args.children if isinstance(args, Tree) else []
            var = bare_ident(exprs[0]) if exprs else None
            if str(method) in _BINDING_MACROS and var is not None and len(exprs) >= 2:
                for e in exprs[1:]:
                    visit(e, bound | {str(var)})
            else:
                visit(args, bound)
            return
        if node.data == "member_dot" and len(node.children) == 2:
            target, field = node.children
            var = bare_ident(target)
            if var is not None and str(var) in FIELDS and str(var) not in bound:
                known = FIELDS[str(var)]
                if str(field) not in known:
                    problems.append(
                        (
                            field.start_pos,  # type: ignore[union-attr]
                            f"undefined field '{field}' on {var} (known: {', '.join(known)})",
                        )
                    )
            visit(target, bound)
            return
        if node.data == "ident":
            tok = node.children[0]
            name = str(tok)
            if (
                identifiers
                and name not in bound
                and name not in VARIABLES
                and name not in _TYPE_NAMES
            ):
                problems.append((tok.start_pos, f"undeclared reference to '{name}'"))  # type: ignore[union-attr]
            return
        for c in node.children:
            visit(c, bound)

    visit(tree, frozenset())
    if result_type:
        kind = _obvious_type(tree)
        if kind is not None:
            problems.append((0, f"expression must be a bool, it is {kind}"))
    problems.sort(key=lambda p: p[0])
    return problems


def _obvious_type(tree: Any) -> str | None:
    """The result type of `tree` when it is obviously not a bool, else None."""
    from lark import Token, Tree

    node = tree
    while isinstance(node, Tree) and node.data in _WRAPPERS and len(node.children) == 1:
        node = node.children[0]
    if isinstance(node, Tree):
        if node.data == "literal" and node.children and isinstance(node.children[0], Token):
            return _LITERAL_TYPES.get(node.children[0].type)
        if node.data in ("list_lit", "map_lit"):
            return node.data[:-4]
        if node.data in ("addition", "multiplication") and len(node.children) == 2:
            return "an arithmetic result"
        if node.data == "unary" and len(node.children) == 2:
            op = node.children[0]
            if isinstance(op, Tree) and op.data == "unary_neg":
                return "a number"
    return None
