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


SINK_SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string", "maxLength": 12},                        # every value at most 12
    "venue": {"type": "string", "examples": ["Hotel Miramar", "The Grand Palace Hotel and Spa"]},
    "body": {"type": "string"},                                          # nothing said of lengths
    "priority": {"type": "string", "enum": ["low", "high"]},            # never matched: not reported
    "note": {"type": "string", "maxLength": 4000},
}}


def test_critical_values_shorter_than_min_match_are_reported_with_what_says_so() -> None:
    revision = build_revision({"upstreams": UPSTREAMS, "tools": {
        "demo.book": {"effect": "external", "schema": SINK_SCHEMA}}, "dataflow": {"mode": "enforce"}})
    found = weak_spots(revision, ToolRegistry())
    assert [(s.subject, s.kind) for s in found] == [
        ("dataflow.critical.demo.book.code", "short_critical_values"),
        ("dataflow.critical.demo.book.venue", "short_critical_values")]
    assert "12 characters long (maxLength)" in found[0].reason and "min_match (32)" in found[0].reason
    assert "13 characters long (example 'Hotel Miramar')" in found[1].reason


def test_min_value_critical_and_declassify_narrow_the_report() -> None:
    def book(**dataflow: Any) -> list[tuple[str, str]]:
        return spots({"tools": {"demo.book": {"effect": "external", "schema": SINK_SCHEMA}},
                      "dataflow": {"mode": "enforce", **dataflow}})
    assert book(min_value=10) == []  # whole values of 10 characters and more are matched
    assert book(min_value=13) == [("dataflow.critical.demo.book.code", "short_critical_values")]
    assert book(critical={"demo.book": ["venue", "body"]}) == [
        ("dataflow.critical.demo.book.venue", "short_critical_values")]
    assert book(declassify={"demo.book": ["code", "venue"]}) == []


def test_escalation_without_a_required_intent_is_reported() -> None:
    assert spots({"dataflow": {"on_tainted": "approve"}}) == [("dataflow.intent", "intent_not_required")]
    assert spots({"dataflow": {"on_tainted": "approve", "intent": "required"}}) == []
    assert spots({"dataflow": {"on_tainted": {"default": "allow"}}}) == []


def test_a_gate_the_intent_waives_is_reported() -> None:
    assert spots({"dataflow": {"waive_gate": "intent"}}) == [("dataflow.waive_gate.default", "gate_waived_by_intent")]
    assert spots({"dataflow": {"waive_gate": {"default": "never", "demo.book": "intent"}}}) == [
        ("dataflow.waive_gate.demo.book", "gate_waived_by_intent")]
    assert spots({"dataflow": {"waive_gate": "never"}}) == []


MOVE_SCHEMA = {"type": "object", "properties": {
    "event_id": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
    "note": {"type": "string"}, "notify": {"type": "boolean"}}}


def test_arguments_a_critical_list_leaves_to_the_attacker_are_reported() -> None:
    """A meeting moved to the attacker's time: `critical: [event_id]` escalates nothing about
    `start`. Reported when tainted runs escalate or the intent waives the gate, naming what is
    left (declassified and boolean arguments are not: the operator chose those)."""
    def move(**dataflow: Any) -> list[Any]:
        revision = build_revision({"upstreams": UPSTREAMS,
                                   "tools": {"demo.move": {"effect": "write", "schema": MOVE_SCHEMA}},
                                   "dataflow": {"mode": "enforce", "intent": "required", **dataflow}})
        return [(s.subject, s.kind, s.reason) for s in weak_spots(revision, ToolRegistry())
                if s.kind == "unchecked_arguments"]
    critical = {"demo.move": ["event_id"]}
    [(subject, kind, reason)] = move(critical=critical, on_tainted="approve", declassify={"demo.move": ["note"]})
    assert (subject, kind) == ("dataflow.critical.demo.move", "unchecked_arguments")
    assert "argument 'start' of sink 'demo.move' is neither critical nor declassified" in reason
    assert reason.startswith("tainted runs escalate it,")
    [(_, _, reason)] = move(critical=critical, waive_gate={"default": "never", "demo.move": "intent"})
    assert "the intent waives its gate" in reason and "'start', 'note'" in reason
    assert move(critical=critical) == []                                   # nothing escalates or waives
    assert move(critical=critical, on_tainted={"default": "approve", "demo.move": "allow"}) == []
    assert move(critical={"demo.move": ["event_id", "start"]}, on_tainted="block",
                declassify={"demo.move": ["note"]}) == []
    assert move(on_tainted="approve") == []                                # absent: every argument counts
