"""Fingerprinting and reading the user's words off the event loop: what one output adds to a
ledger (`delta_of`), what one sink call's arguments ask of it (`probes_of`), what the run's
intent endorses (`endorsement_of`, `intent_words_of`) and asks for (`asking_of`,
`clause_words_of`).

Normalising, token scanning and gram hashing cost time linear in the text, up to the policy's
caps (`max_output_chars`, `max_argument_chars`): up to about 0.7 s of CPU for the largest output
the default caps let through. That must not stall every other call and `/healthz`, so an input
larger than its bound is fingerprinted or read in a worker thread (numpy's hashing releases
the GIL; the Python code between regex matches hands it back at the switch interval, so the
loop waits at most for one C call: tens of milliseconds at the default cap). A smaller one
stays inline. Each bound keeps the worst text of its size (the costliest shape of text for
that path: addresses, numbers, superlatives, clauses...) at about 1 ms on the loop, against
~0.03 ms of the loop's time for a hop to a thread and back (0.03-0.2 ms of the call's;
bench/inline_cost.py, bench/RESULTS.md "Hostile input and bounded resources").

Each of those bounds one step by its characters, but a sink call with many small values passes
every one while their sum is milliseconds. Such a call's whole per-value pipeline runs in one
worker thread (`whole`, sized by `call_work`): there every step above runs inline and the
store reads it makes are sent back to the event loop (`on_loop`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any, ParamSpec, TypeVar

from proxy.envelope.dataflow.endorse import IntentWords
from proxy.envelope.dataflow.intent import Endorsement
from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.dataflow.match import Probe, value_probes
from proxy.envelope.dataflow.waiver import Asking, asking_clauses
from proxy.envelope.labels import Piece
from proxy.policy.model import DEFAULT_MAX_ARGUMENT_CHARS, DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_WINNOW

# Inputs of at most this many characters (all pieces of one output without `min_value`, all
# matched arguments of one call) are fingerprinted inline: typical text costs ~0.02 ms per KB,
# but text dense in tokens (addresses, numbers, non-ASCII words) ~0.17 ms per KB: 6,144
# characters of it ~1.05 ms (12,288, the output bound before: ~2 ms; 8,192: ~1.4 ms).
INLINE_CHARS = 6144
# The bound where hashing costs more per character: an output's whole-value phrases
# (`min_value` on: 2,048 characters of typical text ~1.0 ms, 4,096 ~1.7 ms) and the intent's
# endorsement (0.5 ms at 2,048 for the worst text).
INLINE_CHARS_SLOW = 2048
# What one "&" or "\\" of an argument weighs, in characters, for INLINE_CHARS (`probes_of`).
DECODE_WEIGHT = 16
# The user's words read for picks, criteria and the gate waiver (`IntentWords` with its words
# and criteria, `waiver.asking_clauses`, the asking clauses' objects): ~1.7 ms per KB of the
# worst text (a 4,096-character intent of numbers took 5.8-8.6 ms on the loop, of prose 3.6),
# so only an intent of a few sentences is read inline (512 characters: 0.4-1.0 ms).
INLINE_INTENT_CHARS = 512
# Trusted text when tainted-run escalation records its endorsing keys (`trusted`): every field,
# entry, phrase and criterion key of a listing costs 2-10x an untrusted output's gram hashing
# per character (a 1,000-character listing 2-6 ms, 8,000 characters 29-38 ms, measured on this
# machine), so only a snippet stays inline.
INLINE_CHARS_TRUSTED = 128
# Critical values looked up in the user's words (`IntentWords.endorses`, `spells`, `points_at`,
# the gate waiver's `named`): each lookup can search the whole text, ~20 ns per character when
# the value is found only inside longer words ("aaa" in "aaaa..."), so values times characters
# past this run in a worker thread (256 values against a 16 KiB intent: ~40 ms on the loop).
INLINE_LOOKUPS = 49152
# A sink call's work over all of its values (`call_work`), in characters of the worst text:
# past this, the call's whole per-value pipeline runs in one worker thread (`whole`). Each value
# costs its probe, `Critical.of`, findings, ledger keys and the pick, label and criterion keys
# hashed with the intent's words: 50-170 µs per value of a tainted-run call against a 16 KiB
# intent (16 values 1.1-2.8 ms on the loop, 64 values 4.2-11 ms, measured on this machine with
# bench/inline_cost.py --path "sink call" --values N), so a value weighs VALUE_WORK characters
# (~125 µs at ~0.17 µs per character) and about 8 of them stay inline; a call whose values are
# only fingerprinted (no escalation, no gate waiver: ~20 µs each, 44 values 0.93 ms, 256 values
# 5.5 ms) weighs PROBE_WORK per value, so about 40 short ones stay inline.
INLINE_CALL_WORK = 6144
VALUE_WORK = 768
PROBE_WORK = 128
# The intent this call carries is hashed into each value's pick and label keys (a long word of
# it into every key): one character of it per value costs ~1/32 of a character probed.
INTENT_WORK_DIVISOR = 32
# A list or an object among the values: walked for free text and critical values, not hashed.
CONTAINER_WORK = 16

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")
_END = object()

# Set in a worker thread that runs a whole call's pipeline (`whole`): the event loop to send its
# store reads to. There every bounded step runs inline: it already is off the loop.
_HOME: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "envelope_offload_home", default=None)


async def _off_loop(work: Callable[[], T], executor: Executor | None) -> T:
    if _HOME.get() is not None:
        return work()
    if executor is None:
        return await asyncio.to_thread(work)
    return await asyncio.get_running_loop().run_in_executor(executor, work)


async def delta_of(source: str, parts: Iterable[Piece], n: int, *, limit: int | None = None,
                   window: int = DEFAULT_WINNOW, max_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS,
                   min_value: int = 0, trusted: bool = False, handles: tuple[str, ...] = (),
                   pointed: bool = False, pick_secret: bytes | None = None,
                   executor: Executor | None = None) -> LedgerDelta:
    """`LedgerDelta.of` of one output (same arguments, same result), in a worker thread (the
    default executor, or `executor`) when its pieces hold more than INLINE_CHARS
    characters (INLINE_CHARS_SLOW with `min_value`, INLINE_CHARS_TRUSTED when `trusted` keys are taken of
    a trusted piece).
    Raises what `LedgerDelta.of` raises; cancelling the caller does not stop a thread already
    running (its work is bounded by the caps)."""
    pieces = list(parts)
    size = sum(len(piece.text) for piece in pieces)
    work = functools.partial(LedgerDelta.of, source, pieces, n, limit, window, max_chars, min_value,
                             trusted, handles, pointed, pick_secret)
    if trusted and any(not piece.label.tracked for piece in pieces):
        bound = INLINE_CHARS_TRUSTED
    else:
        bound = INLINE_CHARS_SLOW if min_value else INLINE_CHARS
    if min(size, size if max_chars is None else max_chars) <= bound:
        return work()
    return await _off_loop(work, executor)


async def probes_of(arguments: Iterable[tuple[str, str]], n: int, *, window: int = DEFAULT_WINNOW,
                    max_chars: int | None = DEFAULT_MAX_ARGUMENT_CHARS, min_value: int = 0,
                    executor: Executor | None = None) -> list[tuple[str, Probe]]:
    """(JSON pointer, probe) of each (pointer, text) argument value and of each of its decoded
    readings (`match.value_probes`), in order, in a worker thread when the values to hash
    (those not longer than `max_chars`: an oversized one is not hashed) hold more than
    INLINE_CHARS characters together."""
    values = list(arguments)
    # A character reference or an escape is decoded by a Python call each (`match.readings`:
    # ~1.5 µs, the hashing of ~16 characters): counted so.
    size = sum(len(text) + DECODE_WEIGHT * (text.count("&") + text.count("\\")) for _, text in values
               if max_chars is None or len(text) <= max_chars)

    def work() -> list[tuple[str, Probe]]:
        return [(ptr, probe) for ptr, text in values for probe in value_probes(text, n, window, max_chars, min_value)]

    if size <= INLINE_CHARS:
        return work()
    return await _off_loop(work, executor)


async def intent_words_of(texts: list[str], executor: Executor | None = None, *,
                          prepare: bool = True) -> IntentWords:
    """`IntentWords.of` the run's intent texts, in a worker thread when they hold more than
    INLINE_INTENT_CHARS characters together (`max_intent_chars` allows 1 MiB, which would
    stall the event loop for every sink call of a tainted run). With `prepare`
    (a caller that picks listing entries or reads criteria: `IntentWords.prepared`), its
    `words()` and `criteria()` are computed there too, so the loop never computes them for a
    long intent."""
    def work() -> IntentWords:
        words = IntentWords.of(texts)
        return words.prepared() if prepare else words

    if sum(map(len, texts)) <= INLINE_INTENT_CHARS:
        return IntentWords.of(texts)  # small: `words()` and `criteria()` are computed on demand
    return await _off_loop(work, executor)


async def clause_words_of(objects: list[str], executor: Executor | None = None,
                          ) -> tuple[IntentWords, list[IntentWords]]:
    """(`IntentWords.of` all `objects`, prepared; `IntentWords.of` each one) for the gate
    waiver (the objects of the clauses that ask for the action: `waiver.Asking.object`), in a
    worker thread when they hold more than INLINE_INTENT_CHARS characters together."""
    def work() -> tuple[IntentWords, list[IntentWords]]:
        return IntentWords.of(objects).prepared(), [IntentWords.of([o]) for o in objects]

    if sum(map(len, objects)) <= INLINE_INTENT_CHARS:
        return IntentWords.of(objects), [IntentWords.of([o]) for o in objects]
    return await _off_loop(work, executor)


async def asking_of(tool: str, texts: list[str], executor: Executor | None = None) -> list[Asking]:
    """`waiver.asking_clauses` of the run's intent texts for `tool`, in a worker thread when they
    hold more than INLINE_INTENT_CHARS characters together (linear, but ~1 ms per KiB: a long
    intent would stall the event loop for every gated call)."""
    work = functools.partial(asking_clauses, tool, texts)
    if sum(map(len, texts)) <= INLINE_INTENT_CHARS:
        return work()
    return await _off_loop(work, executor)


async def sized(work: Callable[[], T], chars: int, executor: Executor | None = None, *,
                bound: int = INLINE_CHARS) -> T:
    """`work()`, in a worker thread when the texts it reads hold more than `bound` characters
    (INLINE_CHARS: matching a sink call's arguments against the run's ledger (`DataflowCheck.
    findings`, the fingerprints it asks the store for) walks every gram of them, ~0.2 ms per
    KB (a 60 KB argument held the loop ~11 ms of a 12 ms check); the output guardrails pass
    their own, `proxy.envelope.inspect.INLINE_SCAN_CHARS`)."""
    if chars <= bound:
        return work()
    return await _off_loop(work, executor)


async def each_of(work: Callable[[T], U], items: list[T], chars: int,
                  executor: Executor | None = None) -> list[U]:
    """`[work(item) for item in items]`, where each `work` reads a text of `chars` characters, in
    a worker thread when the items times `chars` exceed INLINE_LOOKUPS."""
    if len(items) * chars <= INLINE_LOOKUPS:
        return [work(item) for item in items]
    return await _off_loop(lambda: [work(item) for item in items], executor)


async def endorsement_of(texts: list[str], n: int, *, window: int = DEFAULT_WINNOW,
                         executor: Executor | None = None) -> Endorsement:
    """`Endorsement.of` the run's intent texts, in a worker thread when they hold more than
    INLINE_CHARS_SLOW characters together (`dataflow.max_intent_chars` may allow up to 1 MiB)."""
    work = functools.partial(Endorsement.of, texts, n, window)
    if sum(map(len, texts)) <= INLINE_CHARS_SLOW:
        return work()
    return await _off_loop(work, executor)


def call_work(arguments: Mapping[str, Any], *, per_value: int, intent_chars: int = 0,
              bound: int | None = None) -> int:
    """The work a sink call's values ask of the check, in characters of the worst text: each
    scalar value (nested ones included) weighs `per_value` (VALUE_WORK when its critical values
    are checked, else PROBE_WORK), plus its characters, plus `intent_chars` (the intent the call
    carries) / INTENT_WORK_DIVISOR; each list or object CONTAINER_WORK (the pipeline walks it).
    Counting stops past `bound` (INLINE_CALL_WORK by default): a hostile call's million values
    are not walked on the loop to learn they are many."""
    limit = INLINE_CALL_WORK if bound is None else bound
    extra = per_value + intent_chars // INTENT_WORK_DIVISOR
    work = 0
    # Iterators, not copies: a list of a million values is read only as far as the bound.
    stack: list[Iterator[Any]] = [iter(arguments.values())]
    while stack and work <= limit:
        value = next(stack[-1], _END)
        if value is _END:
            stack.pop()
        elif isinstance(value, dict):
            stack.append(iter(value.values()))
            work += CONTAINER_WORK
        elif isinstance(value, list):
            stack.append(iter(value))
            work += CONTAINER_WORK
        else:
            work += extra + (len(value) if isinstance(value, str) else 0)
    return work


async def on_loop(read: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """`await read(*args, **kwargs)`, on the event loop: from a worker thread running a whole
    call (`whole`), sent to the loop it came from (the store and the process's ledger views
    belong to that loop) and waited for; elsewhere, awaited here. Raises what `read` raises."""
    home = _HOME.get()
    if home is None:
        return await read(*args, **kwargs)

    async def there() -> T:
        _HOME.set(None)  # this task's own context: the loop's side runs as it would inline
        return await read(*args, **kwargs)

    # No timeout here: the store's own (every store operation has one) ends the read, and the
    # loop runs it (`whole` keeps the calling task waiting until this thread is done).
    return asyncio.run_coroutine_threadsafe(there(), home).result()


def _drive(coroutine: Coroutine[Any, Any, T]) -> T:
    # Every await of a pipeline run by `whole` completes without suspending (its steps run
    # inline, its store reads block on `on_loop`): one send runs it to the end.
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("work sent to a worker thread as a whole waited on an event loop")


async def whole(work: Callable[[], Coroutine[Any, Any, T]], executor: Executor | None = None) -> T:
    """The result of the coroutine `work()`, run in one worker thread from start to end: every
    bounded step of this module runs inline there, and its store reads are sent back to this
    loop (`on_loop`). For a call whose values together cost more than INLINE_CALL_WORK: one hop
    instead of milliseconds on the loop, or one hop per step. Raises what `work()` raises (the
    caller fails closed as it would inline). Cancelled, it waits for the thread to finish
    before it lets the cancellation through (the work is bounded, and it writes to the call)."""
    loop = asyncio.get_running_loop()

    def run() -> T:
        token = _HOME.set(loop)
        try:
            return _drive(work())
        finally:
            _HOME.reset(token)

    done = asyncio.ensure_future(_off_loop(run, executor))
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        await asyncio.wait([done])
        if not done.cancelled():
            done.exception()  # retrieved: nobody waits for the cancelled call's decision
        raise
