"""Suite-wide hooks: after a run, name the test tiers that skipped and how to run them.

On a fresh machine dozens of tests skip because a tool is missing (redis-server, promtool,
chromium, Node 22, a C compiler); `-q` alone hides why. `.ci/run` installs all of them and turns those skips
into failures (`ENVELOPE_REQUIRE_*`), so a skip here only ever means "not installed locally".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

# (tier, words that mark its skip reasons, how to get it locally). First match wins.
TIERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("redis", ("redis-server", "redis"), "apt-get install redis-server"),
    ("promtool", ("promtool",), "apt-get install prometheus"),
    ("browser", ("chromium", "chromedriver", "selenium"),
     "apt-get install chromium chromium-driver"),
    ("node", ("node", "npm"), "npm ci --prefix tests/node (brings Node 22 too)"),
    ("otel", ("otel extra",), "pip install -e '.[otel]' (the dev extra has it)"),
    ("native", ("native winnowing", "native token"),
     "a C compiler (apt-get install gcc), then pip install -e . again"),
)


def skip_reason(report: Any) -> str:
    """The reason a skipped test report gives (pytest keeps it as (path, line, 'Skipped: ...'))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def tier_of(reason: str) -> str:
    lowered = reason.lower()
    for name, words, _ in TIERS:
        if any(word in lowered for word in words):
            return name
    return "other"


def summarize_skips(reasons: Iterable[str]) -> list[str]:
    """One line per skipped tier: how many tests, a reason, and how to run them locally."""
    grouped: dict[str, list[str]] = {}
    for reason in reasons:
        grouped.setdefault(tier_of(reason), []).append(reason)
    how = {name: hint for name, _, hint in TIERS}
    lines = []
    for name in [t[0] for t in TIERS] + ["other"]:
        found = grouped.get(name)
        if not found:
            continue
        distinct = sorted(set(found))
        shown = distinct[0] + (f" (+{len(distinct) - 1} other reasons)" if len(distinct) > 1 else "")
        hint = f"; to run them: {how[name]}" if name in how else ""
        lines.append(f"{name}: {len(found)} skipped: {shown}{hint}")
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    reasons = [skip_reason(r) for r in terminalreporter.stats.get("skipped", [])
               if getattr(r, "when", "") in ("setup", "call")]
    lines = summarize_skips(reasons)
    if not lines:
        return
    terminalreporter.write_sep("-", "skipped test tiers (README, Tests; .ci/run installs them all)")
    for line in lines:
        terminalreporter.write_line(line)
