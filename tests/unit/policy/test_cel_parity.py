"""Both CEL engines give the same answer for the expressions policies use."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from proxy.errors import CelEvalError
from proxy.policy.cel import available_engines, get_engine

ENGINES = ["cel-cpp", "cel-python"]

VARIABLES = {
    "principal": {"id": "alice", "groups": ["eng", "ops"], "claims": {"tier": "gold", "level": 3}},
    "tool": {"name": "create_issue", "upstream": "github", "effect": "external", "annotations": {}},
    "args": {
        "repo": "corp/app",
        "count": 5,
        "labels": ["bug", "p1"],
        "nums": [1, 2, 3],
        "meta": {"k": "v"},
    },
    "run": {
        "id": "r1",
        "parent": "",
        "depth": 1,
        "shadow": False,
        "tainted": True,
        "secret": False,
    },
    "request": {"method": "tools/call", "protocol_version": "2025-06-18", "headers": {}},
    "now": datetime(2025, 6, 1, 12, 0, tzinfo=UTC),
}

CASES = [
    ('args.repo.startsWith("corp/")', True),
    ('args.repo.endsWith("/app")', True),
    ('args.repo.contains("secret")', False),
    ('args.repo.matches("^corp/[a-z]+$")', True),
    ('"eng" in principal.groups', True),
    ('"sales" in principal.groups', False),
    ('"k" in args.meta', True),
    ('"x" in args.meta', False),
    ("has(args.repo)", True),
    ("has(args.missing)", False),
    ("has(principal.claims.tier)", True),
    ("size(args.labels) == 2", True),
    ("args.repo.size() == 8", True),
    ("args.count > 3 && args.count <= 5", True),
    ("run.depth < 2 && run.tainted", True),
    ("args.nums.exists(x, x > 2)", True),
    ("args.nums.all(x, x > 0)", True),
    ("args.nums.all(x, x > 1)", False),
    ("args.nums.exists_one(x, x == 2)", True),
    ('args.labels.filter(l, l.startsWith("p")).size() == 1', True),
    ('now > timestamp("2025-01-01T00:00:00Z")', True),
    ('now < timestamp("2025-01-01T00:00:00Z")', False),
    ('now - timestamp("2025-06-01T11:00:00Z") == duration("1h")', True),
    ("args.missing == 1", "error"),
    ('principal.claims.nope == "x"', "error"),
    ("args.missing == 1 || true", True),
    ("false && args.missing == 1", False),
    ('args.repo == "corp/app" ? true : false', True),
    ("principal.claims.level >= 3", True),
    ('tool.upstream + "." + tool.name == "github.create_issue"', True),
    ("args.count", "error"),
]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param not in available_engines():
        pytest.skip(f"{request.param} is not installed")
    return get_engine(request.param)


def _outcome(engine, expr: str) -> object:  # type: ignore[no-untyped-def]
    program = engine.compile(expr)
    try:
        return program.evaluate(engine.activation(VARIABLES))
    except CelEvalError:
        return "error"


@pytest.mark.parametrize(("expr", "expected"), CASES, ids=[c[0] for c in CASES])
def test_engines_agree(engine, expr: str, expected: object) -> None:  # type: ignore[no-untyped-def]
    assert _outcome(engine, expr) == expected


# A known divergence, pinned so a change in either engine is noticed: cel-cpp implements
# heterogeneous numeric equality (int == double), cel-python 0.5 raises "no such overload".
# Policies should compare like types (`args.count == 5`), which both engines agree on.
@pytest.mark.parametrize("expr", ["args.count == 5.0", "args.count == 5u"])
def test_heterogeneous_equality_diverges(engine, expr: str) -> None:  # type: ignore[no-untyped-def]
    assert _outcome(engine, expr) == (True if engine.name == "cel-cpp" else "error")
