"""README's metrics reference against a running proxy, both ways: every metric the table names is
on `/metrics` of the real `envelope-proxy serve` process with the table's type and labels (after
an allowed call, a refused one and one held for approval), and every family `/metrics` exports
is in the table. A label's listed values (`reason` (`policy`, ...)) are the values the code
declares for it."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e_helpers import fixture_policy, upstream_server, write_doc

from proxy.observability import metrics as declared
from tests.harness import ROOT, mcp_client, proxy_process, token

README = ROOT / "README.md"
OPS = token("ops", tenant="acme")
# A label named in the table, with the values it lists in parentheses (if any).
LABEL = re.compile(r"`([a-z_]+)`(?:\s*\(([^)]*)\))?")


@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    labels: dict[str, tuple[str, ...]]  # label -> the values the table lists (may be empty)


def readme_metrics() -> dict[str, Row]:
    """The rows of README's "Metrics reference" table, by metric name."""
    section = README.read_text(encoding="utf-8").split("## Metrics reference", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows: dict[str, Row] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`envelope_"):
            continue
        name = cells[0].strip("`")
        labels = {m.group(1): tuple(re.findall(r"`([^`]+)`", m.group(2) or ""))
                  for m in LABEL.finditer(cells[2])}
        assert name not in rows, f"README lists {name} twice"
        rows[name] = Row(name, cells[1], labels)
    return rows


def exposition(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Families of a Prometheus text exposition (name -> type) and the label names their
    samples carry (histogram `le` and the `_created` companions left out)."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    # A counter's and a histogram's `_created` series are exported as gauges of their own.
    for name in list(types):
        base = name.removesuffix("_created")
        if base != name and (types.get(base + "_total") == "counter" or base in types):
            del types[name]
    labels: dict[str, set[str]] = {name: set() for name in types}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head = line.rsplit(" ", 1)[0]
        metric, _, rest = head.partition("{")
        family = next((f for f in types if metric == f or (
            types[f] == "histogram" and metric in (f + "_bucket", f + "_sum", f + "_count"))), None)
        if family is None:
            continue
        labels[family] |= set(re.findall(r'(?:^|,)([a-z_]+)="', rest)) - {"le"}
    return types, labels


def test_readme_metrics_table_parses() -> None:
    # A broken table parser would make the test below vacuous.
    rows = readme_metrics()
    assert len(rows) >= 25
    assert rows["envelope_decisions_total"].labels.keys() == {"upstream", "tool", "verdict", "code"}
    assert rows["envelope_approvals_requested_total"].labels["reason"] == declared.APPROVAL_REASONS


def test_readme_label_values_are_the_declared_ones() -> None:
    # The table's value lists are what a dashboard author copies: each is exactly the code's set.
    rows = readme_metrics()
    enumerated = {
        ("envelope_call_duration_seconds", "stage"): declared.STAGES,
        ("envelope_upstream_requests_total", "outcome"): declared.UPSTREAM_OUTCOMES,
        ("envelope_policy_reloads_total", "result"): declared.RELOAD_RESULTS,
        ("envelope_rejected_requests_total", "reason"): declared.REJECT_REASONS,
        ("envelope_admin_rejected_requests_total", "reason"): declared.ADMIN_REJECT_REASONS,
        ("envelope_approvals_requested_total", "reason"): declared.APPROVAL_REASONS,
        ("envelope_headers_dropped_total", "direction"):
            tuple(dict.fromkeys(d for d, _ in declared.HEADER_DROPS)),
        ("envelope_headers_dropped_total", "reason"):
            tuple(dict.fromkeys(r for _, r in declared.HEADER_DROPS)),
    }
    for (name, label), values in enumerated.items():
        assert sorted(rows[name].labels[label]) == sorted(values), f"README: {name}{{{label}}}"
    # Every other metric's label list is the declaration's (the exposition shows only the
    # families some call has touched).
    for spec in declared.METRICS:
        assert set(rows[spec.name].labels) == set(spec.labels), f"README: {spec.name} labels"


def _policy(directory: Path) -> Path:
    """The fixture policy with `notes.delete_note` held for approval for no time: the call is
    refused `approval_pending` at once, so the approval metrics move without a wait."""
    doc = {"version": 1, **fixture_policy()}
    doc["tools"]["notes.delete_note"] = {"effect": "destructive",
                                         "approval": {"required": True, "wait": "0s"}}
    return write_doc(directory, doc)


def test_readme_metrics_reference_matches_a_running_proxy(tmp_path: Path) -> None:
    rows = readme_metrics()
    with upstream_server("sse") as up, proxy_process(
            tmp_path, {"notes": up.url}, policies=_policy(tmp_path / "policies"),
            args=["--record", str(tmp_path / "decisions.jsonl")]) as proxy:

        async def calls() -> None:
            async with mcp_client(proxy.url("notes"), bearer=OPS) as c:
                await c.list_tools()
                allowed = await c.call_tool("echo", {"text": "hi"})
                assert not allowed.is_error
                refused = await c.call_tool("write_note", {"title": "t", "body": "b",
                                                           "folder": "secret"})
                assert refused.is_error
                held = await c.call_tool("delete_note", {"title": "welcome"})
                assert "approval_pending" in held.content[0].text

        asyncio.run(calls())
        text = proxy.metrics()

    types, labels = exposition(text)
    # Every family the proxy exports is documented, and every documented one is exported.
    assert sorted(set(types) - set(rows)) == [], "exported on /metrics but not in README"
    assert sorted(set(rows) - set(types)) == [], "in README but not exported on /metrics"
    for name, row in rows.items():
        assert types[name] == row.kind, f"{name}: exported as {types[name]}, README says {row.kind}"
        if labels[name]:  # a family some call touched: its samples carry the table's labels
            assert labels[name] == set(row.labels), f"{name}: samples carry {labels[name]}"
    # The calls above touched the per-call families, so their labels were compared on the wire.
    touched = {name for name, found in labels.items() if found}
    assert {"envelope_decisions_total", "envelope_call_duration_seconds",
            "envelope_upstream_requests_total", "envelope_approvals_requested_total",
            "envelope_policy_revision_info"} <= touched


@pytest.mark.parametrize("name", ["envelope_decisions_total"])
def test_exposition_parser_reads_labels(name: str) -> None:
    text = (f'# HELP {name} x\n# TYPE {name} counter\n{name}{{upstream="a",tool="t",'
            f'verdict="allow",code="ok"}} 1.0\n# HELP envelope_decisions_created x\n'
            f'# TYPE envelope_decisions_created gauge\nenvelope_decisions_created{{upstream="a"}} 1\n')
    types, labels = exposition(text)
    assert types == {name: "counter"}
    assert labels[name] == {"upstream", "tool", "verdict", "code"}


# -- who may read what on the admin listener --------------------------------------------------

ROUTE = re.compile(r'add_(get|post)\(\s*"([^"]+)"')


def readme_admin_access() -> dict[tuple[str, str], bool]:
    """README's "Who may read what" table: (method, path pattern) -> needs an approver token.
    Patterns keep README's spelling (`<id>`, a trailing `*` for a family of routes); a pattern
    with no method (`/v1/approvals*`) stands for every method ("*")."""
    section = README.read_text(encoding="utf-8").split("Who may read what on the admin listener", 1)[1]
    rows: dict[tuple[str, str], bool] = {}
    for line in section.split("\n\n", 2)[1].splitlines()[2:]:
        endpoints, token = (c.strip() for c in line.strip().strip("|").split("|"))
        for span in re.findall(r"`([^`]*/[^`]*)`", endpoints):
            method, _, path = span.rpartition(" ")
            rows[(method or "*", path)] = token != "none"
    return rows


def _matches(pattern: str, route: str) -> bool:
    """README's `/v1/approvals*` or `/v1/decisions/<id>` against a route `/v1/decisions/{id}`."""
    regex = re.escape(pattern.rstrip("/")).replace(r"\*", ".*")
    regex = re.sub(r"<[^>]+>", "[^/]+", regex.replace(r"\<", "<").replace(r"\>", ">"))
    return re.fullmatch(regex, re.sub(r"\{[^}]+\}", "x", route).rstrip("/")) is not None


def test_readme_admin_table_names_every_admin_route() -> None:
    rows = readme_admin_access()
    assert len(rows) >= 12
    routes = {(m.upper(), path) for source in (ROOT / "proxy" / "admin").glob("*.py")
              for m, path in ROUTE.findall(source.read_text(encoding="utf-8"))}
    assert len(routes) >= 20
    unlisted = sorted(r for r in routes if not any(
        method in (r[0], "*") and _matches(pattern, r[1]) for method, pattern in rows))
    assert unlisted == [], "admin routes README's access table does not name"


def test_readme_admin_table_matches_a_running_proxy(tmp_path: Path) -> None:
    """Each endpoint of the table without a token: 401 when the table says it needs one, never
    401 when it says none; with an approver token, never 401."""
    from tests.harness import ADMIN_TOKEN

    rows = readme_admin_access()
    with upstream_server("sse") as up, proxy_process(tmp_path, {"notes": up.url}) as proxy:
        wrong = []
        for (method, pattern), guarded in rows.items():
            method = "GET" if method == "*" else method
            path = re.sub(r"<[^>]+>", "x", pattern).replace("*", "")
            if path.endswith("/static/"):
                path += "x.js"
            for token in (None, ADMIN_TOKEN):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                reply = httpx.request(method, proxy.admin + path, headers=headers,
                                      json={} if method == "POST" else None, timeout=10)
                refused = reply.status_code == 401
                if refused != (guarded and token is None):
                    wrong.append(f"{method} {path} token={bool(token)}: {reply.status_code}")
    assert wrong == []
