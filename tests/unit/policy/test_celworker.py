"""The compile worker (`proxy/policy/celworker.py`) as the loader runs it: a script in an
isolated interpreter, answering each text with its serialized program or an empty frame."""

from __future__ import annotations

import io
import subprocess

import pytest

from proxy.policy import cel, celworker

pytestmark = pytest.mark.skipif(
    "cel-cpp" not in cel.available_engines(), reason="cel-cpp is not installed"
)


def test_frames_read_back_as_written_and_a_cut_frame_ends_the_stream() -> None:
    data = b"".join(celworker.frame(p) for p in (b"a", b"", "é".encode()))
    stream = io.BytesIO(data + celworker.frame(b"cut short")[:-2])
    read = []
    while (payload := celworker.read_frame(stream)) is not None:
        read.append(payload)
    assert read == [b"a", b"", "é".encode()]


def test_the_worker_compiles_what_compiles_and_answers_empty_for_the_rest() -> None:
    texts = [
        'Pargs.repo.startsWith("corp/") || principal.id == "a"',
        'Fenvelope_re_search(args.q, "^a+$") && size(args.q) < 5',
        'Penvelope_re_search(args.q, "^a+$")',  # the plain environment has no search function
        "Fargs.a ==",  # a syntax error
        "Pnope == 1",  # an undeclared variable
    ]
    out = subprocess.run(
        cel._worker_command(), input=b"".join(celworker.frame(t.encode()) for t in texts),
        capture_output=True, check=True, timeout=60,
    ).stdout
    stream = io.BytesIO(out)
    blobs = []
    while (payload := celworker.read_frame(stream)) is not None:
        blobs.append(payload)
    assert [bool(b) for b in blobs] == [True, True, False, False, False]
    # What comes back is the program the engine would compile: it evaluates here.
    engine = cel.CppEngine()
    program = engine._fast_env.deserialize(blobs[1])
    assert program.eval(engine.activation({"args": {"q": "aaa"}})).value() is True
    assert program.eval(engine.activation({"args": {"q": "b"}})).value() is False
    assert program.eval(engine.activation({"args": {"q": "aaaaaa"}})).value() is False
