"""The CEL seam: one interface, two engines.

`cel-cpp` (PyPI `cel-expr-python`, Google's cel-cpp) is used wherever it has a wheel; the
pure-Python `cel-python` is the automatic fallback. Nothing outside this module imports either
library. Which one runs is the caller's choice, made once: the runtime config's `cel_engine`
(also `ENVELOPE_CEL_ENGINE`, read by `proxy.config`) or a command's `--cel-engine` flag names
it, `get_engine` builds it, and the caller keeps the engine (a policy revision carries the one
that compiled it). This module reads no environment and keeps no engines.

Contract: `Engine.compile(expr)` raises `CelCompileError` (with a 0-based offset where known);
`Engine.activation(vars)` converts the per-call variables once; `Program.evaluate(act)` returns a
bool or raises `CelEvalError` (runtime error or a non-bool result). Callers decide what an error
means (a forbid rule that errors counts as matched, an allow rule as not matched).

Compiling is the cost of loading a policy (a 1,000-tool policy holds ~17,000 expressions), and a
hot reload usually changes a few of them. So each engine keeps the programs it compiled, keyed by
the expression text (an engine's declared variables and functions are fixed when it is built, so
the text is the whole key), and `lint` is cached by text too, the parse it runs by the
expression's literal-free shape (`_shape`: one parse serves every expression that differs only
in literals): a reload compiles only what changed. Every cache is a bounded LRU, so a
long-lived process that sees many revisions does not grow without end. A compiled program is immutable and already shared by
concurrent calls, so sharing it across revisions changes nothing about how it evaluates.

The checks evaluate each group of expressions (a tool's forbid rules, its allow rules, an
`allow` list) as one joined program (`compile_any`). `compile_group` compiles only that joined
program when it proves every member compiles alone, and hands back programs compiled on first
evaluation: a load compiles 3 programs a tool instead of 17 (bench/RESULTS.md, round 3).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib
import io
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from proxy.errors import CelCompileError, CelEvalError
from proxy.policy import celworker
from proxy.policy.cache import LruCache
from proxy.policy.celworker import RE_FUNCTION as _RE_FUNCTION
from proxy.policy.celworker import VARIABLES as VARIABLES  # declared with the worker's env
from proxy.policy.vocab import did_you_mean, re2_options, re2_reason


class Program(Protocol):
    source: str

    def evaluate(self, activation: Any) -> bool: ...


class Engine(Protocol):
    name: str

    def compile(self, expr: str) -> Program: ...

    def compile_any(self, sources: Sequence[str]) -> Program: ...

    def compile_group(self, sources: Sequence[str]) -> tuple[Program, ...] | None: ...

    def precompile(self, groups: Iterable[Sequence[str]]) -> Precompiling: ...

    def activation(self, variables: Mapping[str, Any]) -> Any: ...


_LOCATION = re.compile(r"<input>:(\d+):(\d+):")

# `CppEngine.precompile` hands groups to worker processes only from this many uncompiled groups
# up (a worker starts in ~0.25 s wall; a reload that changed a few tools compiles them here), and
# gives the workers this long before it compiles here instead.
PRECOMPILE_MIN_GROUPS = 200
PRECOMPILE_TIMEOUT = 120.0

# Programs kept per engine: ~17,000 is one 1,000-tool policy with 15 rules a tool; twice that
# holds a revision and the next one while everything changes.
PROGRAM_CACHE_SIZE = 40_000



def _offset(expr: str, message: str) -> int:
    """0-based offset in `expr` from an engine message naming `<input>:line:col`."""
    m = _LOCATION.search(message)
    if not m:
        return 0
    line, col = int(m.group(1)), int(m.group(2))
    lines = expr.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + max(col - 1, 0)


def join_any(sources: Sequence[str]) -> str:
    """`(s1\n) || (s2\n) || ...`: the sources joined so that none can change another's meaning.

    Each source compiled on its own, so its strings and parentheses are closed; the only token
    that can run past its end is a trailing `// comment`, which would swallow the rest of the
    line (later rules silently dropped while the text still compiles). The newline before each
    closing parenthesis ends any such comment inside its own group.
    """
    return " || ".join(f"({src}\n)" for src in sources)


# --- What a joined compile proves -----------------------------------------------------------
#
# cel-cpp's lexer (cel-spec's CEL.g4) for string and bytes literals; what it accepts is what
# these match, with one direction that matters: whatever `_self_contained` accepts lexes there
# exactly as here. Anything unusual is refused, and the caller compiles the source alone.
_HEX = "[0-9a-fA-F]"
_ESC = rf"""\\(?:[abfnrtv"'\\?`]|[xX]{_HEX}{{2}}|u{_HEX}{{4}}|U{_HEX}{{8}}|[0-3][0-7]{{2}})"""
_CPP_LITERAL = re.compile(
    "[bB]?(?:"
    + "|".join([
        rf'"""(?:{_ESC}|[^\\])*?"""',
        rf"'''(?:{_ESC}|[^\\])*?'''",
        rf'"(?:{_ESC}|[^\\"\n\r])*"',
        rf"'(?:{_ESC}|[^\\'\n\r])*'",
        r'[rR]"""[\s\S]*?"""',
        r"[rR]'''[\s\S]*?'''",
        r'[rR]"[^"\n\r]*"',
        r"[rR]'[^'\n\r]*'",
    ])
    + ")"
)
# What the bracket count reads: a literal (not glued to a name or number before it), a comment,
# a bracket, or a quote that opens no literal; names and operators in between are skipped.
_CPP_TOKENS = re.compile(
    rf"(?P<lit>(?<![_a-zA-Z0-9]){_CPP_LITERAL.pattern})|//[^\n]*|[()\[\]{{}}]|(?P<odd>[\"'`])"
)
_CLOSES = {"(": ")", "[": "]", "{": "}"}


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _self_contained(src: str) -> bool:
    """Whether every literal of `src` closes and its brackets balance, in cel-cpp's lexing.

    Inside `join_any`'s `(src\n)` such a source is one parenthesised expression: no token of
    it can reach past its group (a comment ends at the newline), so the joined compile checks
    it exactly as a compile of it alone would. `true) || (false`, or a triple-quoted literal
    left open for a later rule to close, is not self-contained. False whenever in doubt: a
    quote right after a name or number, a backtick, a quote that opens no literal.
    """
    closing: list[str] = []
    for tok in _CPP_TOKENS.finditer(src):
        if tok.lastgroup == "odd":
            return False
        text = tok.group()
        if text in _CLOSES:
            closing.append(_CLOSES[text])
        elif text in (")", "]", "}") and (not closing or closing.pop() != text):
            return False
    return not closing


_ESC_SEQ = re.compile(
    r"""\\(?:(?P<char>[abfnrtv"'\\?`])|[xX](?P<hex>[0-9a-fA-F]{2})|u(?P<u4>[0-9a-fA-F]{4})"""
    r"""|U(?P<u8>[0-9a-fA-F]{8})|(?P<oct>[0-3][0-7]{2}))"""
)
_CHAR_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    '"': '"', "'": "'", "\\": "\\", "?": "?", "`": "`",
}


def _string_value(literal: str) -> str | None:
    """The value of a CEL string literal, as cel-cpp reads it; None for what this leaves to
    the engine (bytes, a carriage return, a raw literal with a backslash, an escape above U+007F:
    forms where dialects differ). Spares a cel-cpp compile per literal `matches` pattern."""
    lexed = _CPP_LITERAL.match(literal)  # where the lexer ends it, not where it could
    if lexed is None or lexed.end() != len(literal) or "\r" in literal:
        return None
    prefix = literal[: len(literal) - len(literal.lstrip("bBrR"))]
    if "b" in prefix or "B" in prefix:
        return None
    quotes = 3 if literal[len(prefix):len(prefix) + 3] in ('"""', "'''") else 1
    body = literal[len(prefix) + quotes:len(literal) - quotes]
    if "\\" not in body:
        return body
    if prefix:  # raw: cel-cpp still reads a backslash before the closing quote (`r"\"` fails)
        return None

    def unescape(m: re.Match[str]) -> str:
        if m.group("char") is not None:
            return _CHAR_ESCAPES[m.group("char")]
        digits = m.group("hex") or m.group("u4") or m.group("u8")
        code = int(digits, 16) if digits else int(m.group("oct"), 8)
        if code > 0x7F:
            raise ValueError(code)
        return chr(code)

    try:
        return _ESC_SEQ.sub(unescape, body)
    except ValueError:
        return None


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


# `_RE_FUNCTION` (from `celworker`) is the function literal `.matches("...")` calls are
# rewritten to: cel-cpp recompiles a regex on every `matches` evaluation (~40 us); this one looks
# the precompiled RE2 pattern up instead.


class CppEngine:
    """cel-cpp through cel-expr-python: parsed, type-checked and planned at compile time."""

    name = "cel-cpp"

    def __init__(self) -> None:
        from cel_expr_python import cel

        self._cel = cel
        variables = celworker.variables(cel)
        self._env = cel.NewEnv(variables=variables)
        self._programs: LruCache[str, _CppProgram] = LruCache(PROGRAM_CACHE_SIZE)
        self._joined: LruCache[tuple[str, ...], Program] = LruCache(PROGRAM_CACHE_SIZE)
        self._rewrites: LruCache[str, str | None] = LruCache(PROGRAM_CACHE_SIZE)
        self._deferred: LruCache[str, _LazyProgram] = LruCache(PROGRAM_CACHE_SIZE)
        self._re2: Any = None
        self._fast_env: Any = None
        try:
            import re2

            self._re2 = re2
            impl = self._re_search
            self._fast_env = cel.NewEnv(
                variables=variables, functions=celworker.functions(cel, impl)
            )
        except ImportError:  # pragma: no cover - google-re2 has wheels where cel-cpp has
            pass

    def _re_search(self, text: str, pattern: str) -> bool:
        return _re2_searcher(self._re2, pattern)(text)

    def _check(self, expr: str) -> Any:
        try:
            compiled = self._env.compile(expr)
        except Exception as exc:
            message = str(exc)
            # "INVALID_ARGUMENT: ERROR: <input>:1:21: found no matching overload ...\n | ..."
            first = message.split("\n", 1)[0]
            first = re.sub(r"^[A-Z_]+: ERROR: <input>:\d+:\d+: ", "", first)
            raise CelCompileError(first, _offset(expr, message)) from exc
        return compiled

    def _fast(self, expr: str) -> str | None:
        """`expr` with literal-pattern `matches` calls rewritten to the precompiled search.

        None when there is nothing to rewrite. Raises CelCompileError for a pattern that RE2
        rejects (caught at load instead of failing every call). Cached by text: the checks
        rewrite every rule again when they join a tool's rules (`compile_any`).
        """
        if self._fast_env is None or "matches" not in expr:
            return None
        return self._rewrites.get_or_build(expr, lambda: self._rewrite(expr))

    def _rewrite(self, expr: str) -> str | None:
        sites = _matches_sites(expr)
        if not sites:
            return None
        for literal_start, literal_end in (site[2] for site in sites):
            literal = expr[literal_start:literal_end]
            pattern = _string_value(literal)
            if pattern is None:  # a form `_string_value` leaves to the engine
                pattern = self._env.compile(literal).eval().value()
            try:
                _re2_compile(self._re2, pattern)
            except Exception as exc:
                raise CelCompileError(f"invalid regular expression {literal}: {re2_reason(exc)}",
                                      literal_start) from exc
        return _apply_sites(expr, sites)

    def compile(self, expr: str) -> _CppProgram:
        """The program for `expr`, compiled once per engine (cached by text)."""
        return self._programs.get_or_build(expr, lambda: self._compile(expr))

    def _compile(self, expr: str) -> _CppProgram:
        try:
            fast = self._fast(expr)
        except Exception:  # a bad pattern, or a literal cel-cpp rejects: the expression's own
            self._checked(expr)  # problem is reported first, as when it compiled first
            raise
        if fast is not None:
            # One compile: the rewrite types exactly as the `matches` calls it replaces (string
            # receiver and pattern, bool result), so it compiles exactly when they do.
            try:
                return _CppProgram(expr, _bool(self._fast_env.compile(fast)))
            except Exception:  # the original is what tells what is wrong (and is correct)
                pass
        return _CppProgram(expr, self._checked(expr))

    def _checked(self, expr: str) -> Any:
        """`expr` compiled as written and known to be a bool, else CelCompileError."""
        return _bool(self._check(expr))

    def compile_any(self, sources: Sequence[str]) -> Program:
        """One program for `(s1) || (s2) || ...`, each source already compiled singly.

        CEL's `||` is exactly "any true wins; an error matters only when nothing is true", so
        the whole list costs one call into cel-cpp instead of one per expression (a 20-rule
        group: ~32 us per call joined, ~94 us as separate programs).
        """
        if len(sources) == 1:
            return self.compile(sources[0])
        key = tuple(sources)
        return self._joined.get_or_build(key, lambda: self._compile_any(key))

    def _compile_any(self, sources: tuple[str, ...]) -> Program:
        parts = [self._fast(src) or src for src in sources]
        env = self._fast_env if self._fast_env is not None else self._env
        joined = join_any(parts)
        try:
            return _CppProgram(joined, env.compile(joined))
        except Exception:  # cannot happen for sources that compile; stay correct regardless
            return _AnyProgram([self.compile(src) for src in sources])

    def compile_group(self, sources: Sequence[str]) -> tuple[Program, ...] | None:
        """A program per source, proven by compiling only their joined group; None when the group
        proves nothing (the caller then compiles each source alone, to report what is wrong).

        Compiling is most of a cold load, and the checks evaluate a tool's rules as one joined
        program (`compile_any`); a single rule's program is needed only to name the rule a
        matching forbid group decided on, and by policy tests. The joined program type-checks
        every source where it stands, as a bool, in the same environment; `_self_contained`
        makes sure no source's tokens reach into a neighbour's, so each parses alone exactly
        as inside the join. So when the group compiles, each source compiles alone, and its own
        program is compiled on first evaluation (`_LazyProgram`). The joined program is cached
        for `compile_any`. Never raises.
        """
        if len(sources) < 2 or self._fast_env is None:
            return None
        # Only the rewrite environment knows the search function: a source naming it would
        # compile joined and fail alone.
        if any(_RE_FUNCTION in src or not _self_contained(src) for src in sources):
            return None
        key = tuple(sources)
        joined = self._joined.get(key)
        if joined is None:
            try:
                parts = [self._fast(src) or src for src in key]  # raises on a bad literal pattern
                text = join_any(parts)
                joined = _CppProgram(text, self._fast_env.compile(text))
            except Exception:  # something in the group does not compile: the caller reports it
                return None
            self._joined.put(key, joined)
        elif not isinstance(joined, _CppProgram):  # a group that compiled only rule by rule
            return None
        # One deferred program per text, like `compile`: a reload hands unchanged rules the
        # same object, whose program, once compiled, serves every revision.
        return tuple(self._deferred.get_or_build(src, functools.partial(_LazyProgram, src, self))
                     for src in sources)

    def precompile(self, groups: Iterable[Sequence[str]]) -> Precompiling:
        """Start compiling, in worker processes, the programs the loader will ask for (each
        group's joined program, or its one source's); `finish()` on the answer keeps them as
        `compile_group` and `compile` would.

        cel-cpp holds the GIL while it compiles, so threads cannot share the work (bench/
        RESULTS.md, round 4); processes can, and a serialized program deserializes here in a
        seventh of a compile. The caller does other work between the two calls. Only what
        `compile_group` and `compile` would compile is sent (self-contained groups, patterns
        that RE2 accepts, in the environment they use), to two workers, and only from
        `PRECOMPILE_MIN_GROUPS` uncompiled groups up on a machine with a core to spare. A
        group a worker cannot compile, a worker that fails or runs past `PRECOMPILE_TIMEOUT`,
        a program that does not deserialize: that group is simply not kept, and the loader
        compiles it here, reporting what is wrong exactly as without this step. Never raises.
        """
        if self._fast_env is None or _spare_cores() < 1:
            return _Done()
        keys: list[tuple[str, ...]] = []
        seen: set[tuple[str, ...]] = set()
        for group in groups:
            key = tuple(group)
            if not key or key in seen:
                continue
            seen.add(key)
            cache: LruCache[Any, Any] = self._joined if len(key) > 1 else self._programs
            if cache.get(key if len(key) > 1 else key[0]) is None:
                keys.append(key)
        if len(keys) < PRECOMPILE_MIN_GROUPS:
            return _Done()
        # Started first: a worker's start-up overlaps the rewriting below.
        workers = _Workers(2)
        sent: list[tuple[tuple[str, ...], str, bool, int]] = []
        for key in keys:
            if any(_RE_FUNCTION in src for src in key):
                continue  # `compile` or `compile_group` says what is wrong with it
            try:
                if len(key) > 1:
                    if not all(_self_contained(src) for src in key):
                        continue
                    text, fast = join_any([self._fast(src) or src for src in key]), True
                else:  # what `_compile` compiles first
                    rewritten = self._fast(key[0])
                    text, fast = rewritten or key[0], rewritten is not None
            except Exception:  # a bad literal pattern: `compile` reports it
                continue
            sent.append((key, text, fast, workers.send(text, fast)))
        return _Collect(self, workers, sent)

    def _keep_serialized(self, key: tuple[str, ...], text: str, fast: bool, blob: bytes) -> bool:
        """Keep what a worker compiled where `compile_group` (a group) or `compile` (a single
        source) would have: only a bool single, as `compile` checks."""
        try:
            expr = (self._fast_env if fast else self._env).deserialize(blob)
            if len(key) == 1:
                _bool(expr)
        except Exception:  # not what this library wrote, or not a bool: compiled here instead
            return False
        if len(key) > 1:
            self._joined.put(key, _CppProgram(text, expr))
        else:
            self._programs.put(key[0], _CppProgram(key[0], expr))
        return True

    def activation(self, variables: Mapping[str, Any]) -> Any:
        return self._env.Activation(dict(variables))


def _spare_cores() -> int:
    """Cores this process may run on besides the one it loads on."""
    try:
        return len(os.sched_getaffinity(0)) - 1
    except AttributeError:  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) - 1


def _worker_command() -> list[str]:
    """How a compile worker is started: this interpreter, isolated (`-I`: no PYTHONPATH, no
    user site; the environment's packages only), running `celworker` as a script."""
    return [sys.executable, "-I", celworker.__file__]


class Precompiling(Protocol):
    started: bool  # whether anything was sent to workers (time for the caller to do other work)

    def finish(self) -> int:
        """Wait for the workers and keep what they compiled; the number of groups kept."""
        ...


class _Done:
    """Nothing was sent to workers."""

    started = False

    def finish(self) -> int:
        return 0


class _Collect:
    """Groups sent to workers: each key, its joined text, its ticket."""

    started = True

    def __init__(self, engine: CppEngine, workers: _Workers,
                 sent: list[tuple[tuple[str, ...], str, bool, int]]):
        self._engine, self._workers, self._sent = engine, workers, sent

    def finish(self) -> int:
        blobs = self._workers.results()
        return sum(
            self._engine._keep_serialized(key, text, fast, blobs[ticket])
            for key, text, fast, ticket in self._sent if blobs[ticket]
        )


class _Workers:
    """`celworker` processes compiling texts as they are sent, dealt out in turn; a writer and a
    reader thread each, so that sending never waits for a worker to catch up."""

    def __init__(self, count: int):
        self._procs: list[subprocess.Popen[bytes]] = []
        self._queues: list[queue.SimpleQueue[bytes | None]] = []
        self._outputs: list[bytes | None] = []
        self._threads: list[threading.Thread] = []
        self._tickets: list[tuple[int, int]] = []  # (worker, frame number) per text sent
        self._counts: list[int] = []
        for _ in range(count):
            try:
                proc = subprocess.Popen(
                    _worker_command(),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                )
            except OSError:
                break
            index = len(self._procs)
            self._procs.append(proc)
            self._queues.append(queue.SimpleQueue())
            self._outputs.append(None)
            self._counts.append(0)
            for target in (self._write, self._read):
                thread = threading.Thread(target=target, args=(index,), daemon=True,
                                          name=f"cel-worker-{index}")
                thread.start()
                self._threads.append(thread)

    def _write(self, index: int) -> None:
        proc, items = self._procs[index], self._queues[index]
        assert proc.stdin is not None
        try:
            while (item := items.get()) is not None:
                proc.stdin.write(item)
            proc.stdin.close()
        except (OSError, ValueError):  # the worker is gone (or was stopped): its texts come
            pass  # back uncompiled

    def _read(self, index: int) -> None:
        proc = self._procs[index]
        assert proc.stdout is not None
        try:
            self._outputs[index] = proc.stdout.read()
        except (OSError, ValueError):
            pass

    def send(self, text: str, fast: bool) -> int:
        """Queue `text`, to compile in the rewrite environment or the plain one, for the next
        worker; its ticket (a place in `results`)."""
        ticket = len(self._tickets)
        if not self._procs:
            self._tickets.append((-1, 0))
            return ticket
        worker = ticket % len(self._procs)
        self._tickets.append((worker, self._counts[worker]))
        self._counts[worker] += 1
        env = b"F" if fast else b"P"
        self._queues[worker].put(celworker.frame(env + text.encode("utf-8", "surrogatepass")))
        return ticket

    def results(self) -> list[bytes]:
        """The serialized program per ticket, b"" where none came back (a text that does not
        compile, a worker that failed or ran past `PRECOMPILE_TIMEOUT`)."""
        for items in self._queues:
            items.put(None)
        deadline = time.monotonic() + PRECOMPILE_TIMEOUT
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        frames: list[list[bytes] | None] = []
        for index, proc in enumerate(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.returncode is None:  # past the deadline
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            frames.append(self._frames(index) if proc.returncode == 0 else None)
        out = []
        for worker, number in self._tickets:
            got = frames[worker] if worker >= 0 else None
            out.append(got[number] if got is not None else b"")
        return out

    def _frames(self, index: int) -> list[bytes] | None:
        """What worker `index` answered, one frame per text sent to it, or None."""
        data = self._outputs[index]
        if data is None:
            return None
        stream = io.BytesIO(data)
        frames = []
        while (payload := celworker.read_frame(stream)) is not None:
            frames.append(payload)
        return frames if len(frames) == self._counts[index] and stream.tell() == len(data) else None


class _LazyProgram:
    """One source of a group whose joined compile proved it compiles: its own program is
    compiled on first evaluation and kept (a cache: the source, and so the verdict, never
    change). Fail closed: should that compile fail after all, evaluating raises
    `CelEvalError`, which the caller treats as any rule error (a forbid rule refuses)."""

    __slots__ = ("_engine", "_program", "source")

    def __init__(self, source: str, engine: CppEngine):
        self.source = source
        self._engine = engine
        self._program: _CppProgram | None = None

    def evaluate(self, activation: Any) -> bool:
        program = self._program
        if program is None:
            try:
                program = self._engine.compile(self.source)
            except CelCompileError as exc:
                raise CelEvalError(f"the expression does not compile: {exc}") from exc
            self._program = program
        return program.evaluate(activation)


def _bool(compiled: Any) -> Any:
    """`compiled` when its result is a bool (or dyn: decided per call), else CelCompileError."""
    rtype = compiled.return_type().name()
    if rtype not in ("BOOL", "DYN", "bool", "dyn"):
        raise CelCompileError(f"expression must be a bool, it is {rtype.lower()}", 0)
    return compiled


@functools.lru_cache(maxsize=4096)
def _re2_compile(re2: Any, pattern: str) -> Any:
    """The RE2 program for a `matches` literal (bounded: evicted patterns recompile on use),
    with `re2_options` (an error is raised, not also logged to stderr)."""
    return re2.compile(pattern, re2_options())


_NO_MATCH = (-1, -1)


@functools.lru_cache(maxsize=4096)
def _re2_searcher(re2: Any, pattern: str) -> Callable[[str], bool]:
    """Whether a `matches` literal matches somewhere in a text: the compiled program's own
    `Match` on the UTF-8 bytes, which is what `search` runs too, without the wrapper's
    generator, `Match` object and character offsets (a sixth of the cost; four a call in the
    bench policy). `search` itself when this `re2` does not expose the program. The program
    is the one the load compiled to check the pattern (`_re2_compile`): the first call does not
    compile it again, on the event loop."""
    compiled = _re2_compile(re2, pattern)
    native = getattr(compiled, "_regexp", None)
    anchor = getattr(getattr(re2, "_Anchor", None), "UNANCHORED", None)
    if native is None or anchor is None or not callable(getattr(native, "Match", None)):
        return lambda text: compiled.search(text) is not None

    def search(text: str) -> bool:
        data = text.encode("utf-8")  # raises on lone surrogates, as `search` does
        return bool(native.Match(anchor, data, 0, len(data))[0] != _NO_MATCH)

    return search


# A few recent parses (a tree is tens of KB): what is read from them, the lint and the `matches`
# sites, is cached by shape on its own, and the two read the same shape one after the other.
@functools.lru_cache(maxsize=256)
def _parse(expr: str) -> Any:
    """cel-python's parse tree of `expr` (never mutated by its readers); None when it does not
    parse."""
    from celpy.celparser import CELParser

    try:
        return CELParser().parse(expr)
    except Exception:
        return None


# --- Literal-free shapes ------------------------------------------------------------------------
#
# The lint and the `matches` rewrite read cel-python's parse tree, and that lark parse (~1 ms in
# pure Python) was two thirds of a cold 1,000-tool load. They never read what is inside a string
# literal: only identifiers, fields, calls and the literal's kind. Real policies repeat a few
# shapes with different literals (`args.repo.startsWith("corp/<team>")` once per tool), so the
# parse runs on the expression with every string literal emptied, cached by that shape, and the
# offsets it yields are mapped back to the expression. Emptying keeps each literal's prefix and
# quotes, so it lexes as the same terminal; the scan below finds literals exactly where
# cel-python's lexer does (a quote outside a comment or literal starts one when the grammar's
# own patterns match there), and an expression whose literals touch a quote (`"a""b"`, which
# empties into one triple-quoted literal) is parsed as it is.

# cel-python's literal terminals (celpy/cel.lark), tried in its lexer's order: bytes, then
# triple-quoted, then single-line strings; the first that matches wins.
_ESC_DQ = r"""\\[abfnrtv"'\\]|\\\d{3}|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4-8}"""
_ESC_SQ = r"""\\[abfnrtv"'\\]|\\\d{3}|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}"""
_ML = (rf'[rR]?"""(?:{_ESC_DQ}|\r\n|\r|\n|.)*?"""', rf"[rR]?'''(?:{_ESC_SQ}|\r\n|\r|\n|.)*?'''")
_SL = (rf'[rR]?"(?:{_ESC_DQ}|.)*?"', rf"[rR]?'(?:{_ESC_SQ}|.)*?'")
_LITERAL = re.compile("|".join([f"[bB]{p}" for p in (*_ML, *_SL)] + [*_ML, *_SL]), re.M)
# What the scan steps over: a comment, an identifier (maybe a literal's prefix), a quote, a run
# of anything else.
_SCAN = re.compile(r"""//.*|[_a-zA-Z][_a-zA-Z0-9]*|["']|(?P<run>[^"'/_a-zA-Z]+)|/""", re.M)
_PREFIXES = frozenset({"r", "R", "b", "B", "br", "bR", "Br", "BR"})
_QUOTES = frozenset({'"', "'"})
_DIGITS = re.compile(r"[0-9]+")

# Where the emptied literals and numbers are: (end in the shape, characters removed up to there)
# each.
Spans = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _shape(expr: str) -> tuple[str, Spans] | None:
    """`expr` with every string literal's content removed and every run of digits outside
    identifiers made one digit, and where; None when a literal ends right before a quote
    (emptying could merge it with the next one)."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = length = removed = 0
    end = len(expr)
    while pos < end:
        tok = _SCAN.match(expr, pos)
        assert tok is not None  # its last alternatives match any character
        text = tok.group()
        lit = None
        if text in _QUOTES or (text in _PREFIXES and expr[tok.end():tok.end() + 1] in _QUOTES):
            lit = _LITERAL.match(expr, pos)
        if lit is None:
            pos = tok.end()
            if tok.lastgroup == "run" and _DIGITS.search(text):
                # A number keeps its kind, not its value: the `.`, `e` and `u` around digits
                # stay, and a lone `0` stays `0` (`0x1F` is hex; `10x1F`, a number and a name).
                at = 0
                for digits in _DIGITS.finditer(text):
                    piece = text[at:digits.start()] + ("0" if digits.group() == "0" else "1")
                    out.append(piece)
                    length += len(piece)
                    removed += len(digits.group()) - 1
                    spans.append((length, removed))
                    at = digits.end()
                text = text[at:]
            out.append(text)
            length += len(text)
            continue
        if expr[lit.end():lit.end() + 1] in _QUOTES:
            return None
        body = lit.group()
        opening = body.lstrip("bBrR")
        prefix = body[: len(body) - len(opening)]
        # A match that opens with three quotes is triple-quoted (a single-quoted one that opens
        # with two is the empty string and ends there).
        quote = opening[:3] if opening[:3] in ('"""', "'''") else opening[0]
        empty = prefix + quote + quote
        out.append(empty)
        length += len(empty)
        removed += len(body) - len(empty)
        spans.append((length, removed))
        pos = lit.end()
    return "".join(out), tuple(spans)


def _unshape(spans: Spans, offset: int) -> int:
    """The offset in the expression of `offset` in its shape (outside literals, or at a
    literal's start or end)."""
    i = bisect.bisect_right(spans, (offset, sys.maxsize))
    return offset + (spans[i - 1][1] if i else 0)


Site = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def _matches_sites(expr: str) -> list[Site]:
    """`recv.matches("lit")` and `matches(s, "lit")` calls: (call span, receiver span, literal span)."""
    shaped = _shape(expr)
    if shaped is None:
        return list(_parsed_sites(expr))
    shape, spans = shaped

    def at(offset: Any) -> Any:
        # A bool literal's node has no position (cel-python's lexer callback makes a new
        # token): None, as the parse of the expression itself says.
        return offset if offset is None else _unshape(spans, offset)

    return [
        ((at(a), at(b)), (at(c), at(d)), (at(e), at(f)))
        for (a, b), (c, d), (e, f) in _parsed_sites(shape)
    ]


@functools.lru_cache(maxsize=4096)
def _parsed_sites(expr: str) -> list[Site]:
    """`_matches_sites` read from the parse of `expr` itself (cached: callers only read it)."""
    tree = _parse(expr)
    if tree is None:
        return []
    sites = []
    for node in tree.iter_subtrees():
        kids = node.children
        if node.data == "member_dot_arg" and len(kids) == 3:
            recv, name, args = kids
            if getattr(name, "value", None) != "matches" or len(args.children) != 1:
                continue
            lit = _string_literal(args.children[0])
            if lit is not None:
                sites.append(((node.meta.start_pos, node.meta.end_pos),
                              (recv.meta.start_pos, recv.meta.end_pos), lit))
        elif node.data == "ident_arg" and len(kids) == 2:
            name, args = kids
            if getattr(name, "value", None) != "matches" or len(args.children) != 2:
                continue
            lit = _string_literal(args.children[1])
            first = args.children[0]
            if lit is not None:
                sites.append(((node.meta.start_pos, node.meta.end_pos),
                              (first.meta.start_pos, first.meta.end_pos), lit))
    return sites


def _string_literal(node: Any) -> tuple[int, int] | None:
    """The span of `node` when it is nothing but one string literal."""
    while hasattr(node, "children") and len(node.children) == 1 and hasattr(node.children[0], "children"):
        node = node.children[0]
    if getattr(node, "data", None) == "literal" and len(node.children) == 1:
        tok = node.children[0]
        if getattr(tok, "type", "") in ("STRING_LIT", "MLSTRING_LIT"):
            return (tok.start_pos, tok.end_pos)
    return None


def _apply_sites(expr: str, sites: list[Site]) -> str:
    """Render `expr` with every site replaced, innermost sites inside receivers included."""
    return _render(expr, sorted(sites), 0, len(expr))


def _render(expr: str, sites: list[Site], start: int, end: int) -> str:
    """`expr[start:end]` with the sites inside it replaced. (A module function, not a closure
    calling itself: that would be a reference cycle per expression, left for the collector.)"""
    out, pos = [], start
    for call, recv, lit in sites:
        if call[0] < pos or call[1] > end:  # outside this span, or inside a site already done
            continue
        out.append(expr[pos:call[0]])
        out.append(f"{_RE_FUNCTION}({_render(expr, sites, recv[0], recv[1])}, "
                   f"{expr[lit[0]:lit[1]]})")
        pos = call[1]
    out.append(expr[pos:end])
    return "".join(out)


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


class _AnyProgram:
    """`any` over programs with CEL `||` semantics: true wins, else the first error, else false."""

    __slots__ = ("_programs", "source")

    def __init__(self, programs: Sequence[Program]):
        self._programs = tuple(programs)
        self.source = join_any([p.source for p in self._programs])

    def evaluate(self, activation: Any) -> bool:
        error: CelEvalError | None = None
        for program in self._programs:
            try:
                if program.evaluate(activation):
                    return True
            except CelEvalError as exc:
                error = error or exc
        if error is not None:
            raise error
        return False


class PyEngine:
    """cel-python: pure Python, ~100x slower; the fallback where cel-cpp has no wheel."""

    name = "cel-python"

    def __init__(self) -> None:
        import celpy

        self._celpy = celpy
        self._env = celpy.Environment()
        self._programs: LruCache[str, _PyProgram] = LruCache(PROGRAM_CACHE_SIZE)
        self._joined: LruCache[tuple[str, ...], Program] = LruCache(PROGRAM_CACHE_SIZE)

    def compile(self, expr: str) -> _PyProgram:
        """The program for `expr`, compiled once per engine (cached by text)."""
        return self._programs.get_or_build(expr, lambda: self._compile(expr))

    def _compile(self, expr: str) -> _PyProgram:
        try:
            ast = self._env.compile(expr)
            prog = self._env.program(ast)
        except Exception as exc:
            raise CelCompileError(*_py_syntax_error(expr, exc)) from exc
        return _PyProgram(expr, prog)

    def compile_any(self, sources: Sequence[str]) -> Program:
        key = tuple(sources)
        return self._joined.get_or_build(key, lambda: self._compile_any(key))

    def _compile_any(self, sources: tuple[str, ...]) -> Program:
        programs = [self.compile(src) for src in sources]
        return programs[0] if len(programs) == 1 else _AnyProgram(programs)

    def compile_group(self, sources: Sequence[str]) -> tuple[Program, ...] | None:
        """None: cel-python joins nothing, so each source is compiled (and checked) alone."""
        return None

    def precompile(self, groups: Iterable[Sequence[str]]) -> Precompiling:
        """Nothing: cel-python's programs do not serialize; each is compiled when needed."""
        return _Done()

    def activation(self, variables: Mapping[str, Any]) -> Any:
        from celpy import celtypes

        act: dict[str, Any] = {}
        for key, value in variables.items():
            if key == "now":
                act[key] = celtypes.TimestampType(value)
            else:
                act[key] = self._celpy.json_to_cel(value)
        return act


# The library each engine needs (what its constructor imports).
_LIBRARIES = {"cel-cpp": "cel_expr_python.cel", "cel-python": "celpy"}


def available_engines() -> list[str]:
    """Engine names that can be built on this machine (their library imports)."""
    names = []
    for name, library in _LIBRARIES.items():
        try:
            importlib.import_module(library)
        except ImportError:
            continue
        names.append(name)
    return names


def get_engine(name: str = "auto") -> Engine:
    """A new engine of that name (`auto`, `cel-cpp`, `cel-python`); auto prefers cel-cpp.

    Callers keep the engine they get: programs compiled by one engine are evaluated with that
    engine's activations. Raises `CelCompileError` when the name is unknown or the engine is
    not installed.
    """
    name = name.strip()
    if name == "auto":
        try:
            return get_engine("cel-cpp")
        except CelCompileError:
            return get_engine("cel-python")
    if name not in _LIBRARIES:
        raise CelCompileError(f"unknown CEL engine {name!r} (auto, cel-cpp, cel-python)")
    try:
        return CppEngine() if name == "cel-cpp" else PyEngine()
    except ImportError as exc:
        raise CelCompileError(f"CEL engine {name} is not installed: {exc}") from exc


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
# The type of each fixed-shape field whose values have one type (`run.parent` may be null:
# comparing it with null is right, so it is left out), for the comparison check of `_lint_parsed`.
FIELD_TYPES: dict[tuple[str, str], str] = {
    ("principal", "id"): "string", ("principal", "groups"): "list", ("principal", "claims"): "map",
    ("tool", "name"): "string", ("tool", "upstream"): "string", ("tool", "effect"): "string",
    ("tool", "annotations"): "map",
    ("run", "id"): "string", ("run", "depth"): "int", ("run", "shadow"): "bool",
    ("run", "tainted"): "bool", ("run", "secret"): "bool",
    ("request", "method"): "string", ("request", "protocol_version"): "string",
    ("request", "headers"): "map",
}
_RELATIONS = frozenset({"relation_eq", "relation_ne", "relation_lt", "relation_le", "relation_gt",
                        "relation_ge"})
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
    "BOOL_LIT": "bool",
}


def lint(expr: str, *, identifiers: bool = True, result_type: bool = True) -> list[tuple[int, str]]:
    """Problems the engines miss, as (0-based offset, message), in source order.

    Cached by its arguments (the result depends on nothing else); the caller gets its own list.

    Unknown fields on the fixed-shape variables, and a typed field of them compared with a
    literal of another type, always; with `identifiers`, references to undeclared variables
    (macro variables are bound, not undeclared); with `result_type` (what cel-cpp's checker
    finds itself, for cel-python), a result that is obviously not a bool (a literal, arithmetic,
    a list or map) and a comparison of literals or `now` with a literal of another type. An expression
    that does not parse yields nothing here: the engine reports the syntax error.
    """
    return list(_lint(expr, identifiers, result_type))


@functools.lru_cache(maxsize=PROGRAM_CACHE_SIZE)
def _lint(expr: str, identifiers: bool, result_type: bool) -> tuple[tuple[int, str], ...]:
    """`lint` of the expression's literal-free shape, its offsets mapped back (see `_shape`)."""
    shaped = _shape(expr)
    if shaped is None:
        return _lint_parsed(expr, identifiers, result_type)
    shape, spans = shaped
    return tuple(
        # A finding about the whole expression has no offset (a comparison of two literals):
        # there is nothing to map back.
        (offset if offset is None else _unshape(spans, offset), message)
        for offset, message in _lint_parsed(shape, identifiers, result_type)
    )


@functools.lru_cache(maxsize=4096)
def _lint_parsed(expr: str, identifiers: bool, result_type: bool) -> tuple[tuple[int, str], ...]:
    """`lint` read from the parse of `expr` itself."""
    from lark import Token, Tree

    tree = _parse(expr)
    if tree is None:
        return ()
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

    def operand(node: Any, bound: frozenset[str]) -> tuple[str, str, int] | None:
        """(what, type, offset) of a comparison operand whose type is known: a typed field of
        a fixed-shape variable, or a literal; else None."""
        while isinstance(node, Tree) and node.data in _WRAPPERS and len(node.children) == 1:
            node = node.children[0]
        if not isinstance(node, Tree):
            return None
        now = bare_ident(node)
        if now is not None and str(now) == "now" and "now" not in bound:
            return "now", "timestamp", now.start_pos  # type: ignore[return-value]
        if node.data == "literal" and node.children and isinstance(node.children[0], Token):
            tok = node.children[0]
            kind = _LITERAL_TYPES.get(tok.type)
            return (f"{_article(kind)} {kind} literal", kind, tok.start_pos) if kind else None  # type: ignore[return-value]
        if node.data == "member_dot" and len(node.children) == 2:
            target, field = node.children
            var = bare_ident(target)
            if var is not None and str(var) not in bound:
                kind = FIELD_TYPES.get((str(var), str(field)))
                if kind is not None:
                    return f"{var}.{field}", kind, var.start_pos  # type: ignore[return-value]
        return None

    def compare(node: Any, bound: frozenset[str]) -> None:
        """A problem when a comparison's two sides have known, different types (`run.depth ==
        "1"`, `tool.effect == 1`): every variable is a map of dyn to the engines, so neither sees
        it, and the rule is never true (==) or an error at every call (<, >: a forbid matches)."""
        left, right = operand(node.children[0].children[0], bound), operand(node.children[1], bound)
        if left is None or right is None or left[1] == right[1] or "null_type" in (left[1], right[1]):
            return
        if {left[1], right[1]} <= {"int", "uint", "double"}:
            return  # numbers compare across kinds
        field, other = (left, right) if "literal" not in left[0] else (right, left)
        if ("literal" in field[0] or field[0] == "now") and not result_type:
            return  # literals and `now` are typed to cel-cpp, which reports this itself
        if "literal" in field[0]:
            problems.append((left[2], f"{left[0]} compared with {right[0]}"))
            return
        problems.append((field[2], f"{field[0]} is {_article(field[1])} {field[1]}, compared here "
                                   f"with {other[0]}"))

    def visit(node: Any, bound: frozenset[str]) -> None:
        if not isinstance(node, Tree):
            return
        if (node.data == "relation" and len(node.children) == 2 and isinstance(node.children[0], Tree)
                and node.children[0].data in _RELATIONS and len(node.children[0].children) == 1):
            compare(node, bound)
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
                            f"undefined field '{field}'{did_you_mean(str(field), known)} on {var} "
                            f"(known: {', '.join(known)})",
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
                problems.append((tok.start_pos,  # type: ignore[union-attr]
                                 f"undeclared reference to '{name}'{did_you_mean(name, VARIABLES)}"))
            return
        for c in node.children:
            visit(c, bound)

    visit(tree, frozenset())
    if result_type:
        kind = _obvious_type(tree)
        if kind is not None:
            problems.append((0, f"expression must be a bool, it is {kind}"))
    problems.sort(key=lambda p: p[0])
    return tuple(problems)


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


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
