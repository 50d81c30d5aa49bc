"""`check`'s weak spots: destructive effects no person confirms, sinks open to untrusted text."""

from __future__ import annotations

from typing import Any

from envelope_helpers import UPSTREAMS, build_revision

from proxy.envelope.checks.catalogue import weak_spots
from proxy.envelope.tools import ToolRegistry


def spots(doc: dict[str, Any]) -> list[tuple[str, str]]:
    revision = build_revision({"upstreams": UPSTREAMS, **doc})
    return [(s.subject, s.kind) for s in weak_spots(revision, ToolRegistry())]


def test_the_default_gates_have_no_weak_spot() -> None:
    assert spots({"tools": {"demo.drop": {"effect": "destructive"},
                            "demo.send": {"effect": "external"}}}) == []


def test_destructive_effects_nobody_confirms_are_reported_where_they_are_set() -> None:
    found = spots({
        "defaults": {"gated_effects": ["external"]},
        "principals": {"ops": {"gated_effects": []}, "careful": {"gated_effects": ["destructive"]}},
        "tools": {"demo.drop": {"effect": "destructive", "approval": {"required": False}},
                  "demo.note": {"effect": "write", "approval": {"required": False}},
                  "demo.wipe": {"effect": "destructive"}},
    })
    assert found == [("defaults.gated_effects", "ungated_destructive"),
                     ("principals.ops.gated_effects", "ungated_destructive"),
                     ("tools.demo.drop.approval", "ungated_destructive")]


def test_sinks_with_every_argument_declassified() -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}}}
    found = spots({
        "tools": {"demo.post": {"effect": "write"}, "demo.note": {"effect": "write", "schema": schema},
                  "demo.mail": {"effect": "write", "schema": schema}},
        "dataflow": {"declassify": {"demo.post": True, "demo.note": ["title", "body"],
                                    "demo.mail": ["body"]}},
    })
    assert found == [("dataflow.declassify.demo.note", "all_declassified"),
                     ("dataflow.declassify.demo.post", "all_declassified")]
