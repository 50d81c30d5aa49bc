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
        from cel_expr_python import cel  # type: ignore[import-not-found]

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
            message = str(exc).strip()
            offset = getattr(exc, "column", None)
            if isinstance(offset, int) and offset > 0:
                raise CelCompileError(f"syntax error: {message.splitlines()[0]}", offset - 1) from exc
            raise CelCompileError(f"syntax error: {message.splitlines()[0] if message else exc!r}", 0) from exc
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
    try:
        engine: Engine = CppEngine() if name == "cel-cpp" else PyEngine() if name == "cel-python" else None  # type: ignore[assignment]
    except ImportError as exc:
        raise CelCompileError(f"CEL engine {name} is not installed: {exc}") from exc
    if engine is None:
        raise CelCompileError(f"unknown CEL engine {name!r} (auto, cel-cpp, cel-python)")
    _ENGINES[name] = engine
    return engine
