"""Compile CEL in another process: the cel-cpp environment's declarations, and a worker that
compiles texts and answers with their serialized checked programs.

cel-expr-python holds the GIL while it compiles (two threads compile no faster than one,
bench/RESULTS.md "Policy load at scale", round 4), and compiling is the largest stage of a cold
load; but a compiled `Expression` serializes, and `Env.deserialize` costs about a seventh of a
compile. So a cold load hands its rule groups to two worker processes (on a machine with a
second core) and only deserializes in the loading thread (`proxy.policy.cel.CppEngine.precompile`).

The worker runs as a script (`python -I <this file>`): it imports the standard library and
cel-expr-python only, not the `proxy` package, so it starts in ~70 ms of CPU and cannot pick up
another tree's `proxy`. The declarations live here so that the engine and the worker build the
same environment from one definition.

Wire format, both ways: frames of a 4-byte little-endian length and that many bytes. In: one
frame per text until stdin closes: `F` (the rewrite environment, with the search function) or
`P` (the plain one), then the text in UTF-8. Out: one frame per text, in order: the serialized
program, or an empty frame when the text does not compile (the caller then compiles it itself,
to report why).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, BinaryIO

# Variables visible to CEL, all maps of string to dyn except `now`.
VARIABLES = ("principal", "tool", "args", "run", "request", "now")
# The function literal `.matches("...")` calls are rewritten to (`proxy.policy.cel`).
RE_FUNCTION = "envelope_re_search"


def variables(cel: Any) -> dict[str, Any]:
    """The declared variables of every environment the engine compiles in."""
    dyn_map = cel.Type.Map(cel.Type.STRING, cel.Type.DYN)
    declared = {v: dyn_map for v in VARIABLES if v != "now"}
    declared["now"] = cel.Type.TIMESTAMP
    return declared


def functions(cel: Any, impl: Callable[[str, str], bool]) -> list[Any]:
    """The functions of the rewrite environment: the precompiled `matches` search."""
    return [cel.FunctionDecl(RE_FUNCTION, [cel.Overload(
        f"{RE_FUNCTION}_string_string", cel.Type.BOOL,
        [cel.Type.STRING, cel.Type.STRING], is_member=False, impl=impl,
    )])]


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame of `stream`; None at its end (or inside a frame cut short)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = int.from_bytes(head, "little")
    payload = stream.read(size)
    return payload if len(payload) == size else None


def _never(text: str, pattern: str) -> bool:
    """The search's implementation here: the worker compiles, it never evaluates."""
    raise RuntimeError("compile-only environment")


def main() -> None:
    """Compile each text as it arrives (the loader is still preparing the next ones) until
    stdin closes."""
    from cel_expr_python import cel

    envs = {
        b"F"[0]: cel.NewEnv(variables=variables(cel), functions=functions(cel, _never)),
        b"P"[0]: cel.NewEnv(variables=variables(cel)),
    }
    source, out = sys.stdin.buffer, sys.stdout.buffer
    while (payload := read_frame(source)) is not None:
        try:
            blob = envs[payload[0]].compile(payload[1:].decode("utf-8")).serialize()
        except Exception:  # the caller compiles it itself and reports what is wrong
            blob = b""
        out.write(frame(blob))
    out.flush()


if __name__ == "__main__":
    main()
