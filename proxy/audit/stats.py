"""Aggregates of an audit log over a time window, for the review page's picture.

`window_stats` reads records newest first (`proxy.audit.query.iter_records`) and counts the
calls among them that match the filters into time buckets by verdict, plus the refused (deny
and error) tools and codes. Records of admin actions (`NOT_CALLS`) are not calls. The work is bounded: at most `max_scan` records of the window are read (past the
window's start reading stops, rotated files older than it are never opened); when the bound is
hit the answer says `truncated` and from which time it is complete, never a silent undercount.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from proxy.audit.query import ts_key
from proxy.envelope.types import Verdict

VERDICTS = tuple(v.value for v in Verdict)
REFUSED = frozenset({Verdict.DENY.value, Verdict.ERROR.value})
# Records read for one answer. Measured: 1-2 s for 100 000 records (parsing most of it) on one
# core of a busy 2-core machine.
MAX_SCAN = 100_000
MAX_BUCKETS = 180  # bars in the picture; wider windows get wider buckets (whole minutes)
TOP = 5
# Methods of the records the admin API writes (`proxy.envelope.outcome`: `note_approval`,
# `note_failed_approver`, `note_intent`, `note_release`): a person's decision, a failed approver
# token, an intent set, an idempotency key released. They are in the log and the table, not calls: counted, a token-guessing flood
# would stand among the top refused tools.
NOT_CALLS = frozenset({"<approval>", "<intent>", "<idempotency>"})


def bucket_seconds(window: timedelta) -> int:
    """One minute, or the smallest whole number of minutes that keeps the window within
    MAX_BUCKETS buckets."""
    minutes = math.ceil(window.total_seconds() / 60 / MAX_BUCKETS)
    return 60 * max(minutes, 1)


def _top(counter: Counter[str], key: str) -> list[dict[str, Any]]:
    # Ties ordered by name, so the answer is stable from one refresh to the next.
    ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]
    return [{key: name, "count": n} for name, n in ranked]


def window_stats(
    records: Iterable[Mapping[str, Any]],
    *,
    since: datetime,
    until: datetime,
    match: Callable[[Mapping[str, Any]], bool],
    max_scan: int = MAX_SCAN,
) -> dict[str, Any]:
    """Counts of the calls in [since, until) that satisfy `match` (records of admin actions,
    `NOT_CALLS`, are skipped), from `records` given newest first (JSON types).

    Answer: `since`, `until`, `bucket_seconds`, `buckets` (oldest first: `start` and a count per
    verdict), `totals` per verdict, `count`, `top_refused_tools` (`upstream.tool`) and
    `top_refused_codes` (at most TOP each, deny and error verdicts), `scanned` (records of the
    window read), `truncated` and `complete_from` (the oldest time counted in full: `since`
    unless truncated). A record with another verdict or no `ts` is skipped.
    """
    since, until = since.astimezone(UTC), until.astimezone(UTC)
    step = bucket_seconds(until - since)
    # Buckets are aligned to whole minutes since the epoch, so two refreshes share edges.
    first = datetime.fromtimestamp(math.floor(since.timestamp() / step) * step, UTC)
    n_buckets = max(math.ceil((until - first).total_seconds() / step), 1)
    starts = [first + timedelta(seconds=i * step) for i in range(n_buckets)]
    edges = [ts_key(s) for s in starts]  # `ts` strings compare in time order
    lo, hi = ts_key(since), ts_key(until)
    counts = [dict.fromkeys(VERDICTS, 0) for _ in starts]
    tools: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    scanned = 0
    truncated = False
    complete_from = lo
    for rec in records:
        ts = rec.get("ts")
        if not isinstance(ts, str) or ts >= hi:
            continue
        if ts < lo:
            break  # newest first: nothing further is in the window
        if scanned >= max_scan:
            truncated, complete_from = True, ts
            break
        scanned += 1
        verdict = rec.get("verdict")
        if verdict not in VERDICTS or rec.get("method") in NOT_CALLS or not match(rec):
            continue
        counts[bisect.bisect_right(edges, ts) - 1][verdict] += 1
        if verdict in REFUSED:
            tools[f"{rec.get('upstream')}.{rec.get('tool')}"] += 1
            codes[str(rec.get("code"))] += 1
    if truncated:
        # Everything at or after the record we stopped at is counted in full; the bucket the
        # stop fell in is not, so it is said (`complete_from`) rather than hidden.
        complete_from = _next_ts(complete_from)
    totals = {v: sum(c[v] for c in counts) for v in VERDICTS}
    return {
        "since": lo,
        "until": hi,
        "bucket_seconds": step,
        "buckets": [{"start": e, **c} for e, c in zip(edges, counts, strict=True)],
        "totals": totals,
        "count": sum(totals.values()),
        "top_refused_tools": _top(tools, "tool"),
        "top_refused_codes": _top(codes, "code"),
        "scanned": scanned,
        "truncated": truncated,
        "complete_from": complete_from,
    }


def _next_ts(ts: str) -> str:
    """The smallest `ts` after `ts` (one microsecond later), or `ts` when it does not parse."""
    try:
        return ts_key(datetime.fromisoformat(ts.replace("Z", "+00:00")) + timedelta(microseconds=1))
    except ValueError:
        return ts
