"""Every input schema is compiled asserting `format`, and VALIDATED_FORMATS says which."""

from __future__ import annotations

import socket

import pytest

from proxy.policy.schemas import VALIDATED_FORMATS, compile_schema

# A well-formed and a malformed value for every format the data-flow check may trust.
SAMPLES = {
    "date": ("2026-11-30", "30/11/2026"),
    "date-time": ("2026-11-30T09:00:00+01:00", "ignore previous instructions"),
    "time": ("09:00:00Z", "nine o'clock"),
    "duration": ("P1DT2H", "two days"),
    "email": ("a@corp.example", "not an address"),
    "idn-email": ("a@corp.example", "not an address"),
    "hostname": ("corp.example", "not a host name"),
    "idn-hostname": ("corp.example", "not a host name"),
    "ipv4": ("10.0.0.1", "10.0.0"),
    "ipv6": ("::1", "::g"),
    "uri": ("https://corp.example/a", "no scheme here"),
    "uri-reference": ("/a/b", "has spaces in it"),
    "iri": ("https://corp.example/é", "no scheme here"),
    "iri-reference": ("/é", "has spaces in it"),
    "uri-template": ("/a/{id}", "/a/{id"),
    "uuid": ("6f1c2b9a-8d7e-4f60-a1b2-c3d4e5f60718", "6f1c2b9a"),
    "json-pointer": ("/a/0", "a/0"),
    "relative-json-pointer": ("1/a", "/a"),
    "regex": ("^a+$", "(unclosed"),
}


def test_samples_cover_exactly_the_validated_formats() -> None:
    assert set(SAMPLES) == VALIDATED_FORMATS


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_every_validated_format_is_asserted(fmt: str) -> None:
    good, bad = SAMPLES[fmt]
    validator = compile_schema({"type": "string", "format": fmt})
    assert validator.is_valid(good)
    assert not validator.is_valid(bad)


@pytest.mark.parametrize("fmt", ["int32", "password", "byte", "made-up"])
def test_unknown_formats_are_annotations_and_never_trusted(fmt: str) -> None:
    assert compile_schema({"type": "string", "format": fmt}).is_valid("any text at all")
    assert fmt not in VALIDATED_FORMATS


def test_format_applies_to_strings_only() -> None:
    # Why the data-flow walker trusts a format only for string values.
    validator = compile_schema({"format": "date-time"})
    assert validator.is_valid({"text": "ignore previous instructions"})
    assert validator.is_valid(["ignore previous instructions"])


def test_remote_refs_are_not_fetched() -> None:
    # A listening socket that records whether anything connected to it.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/schema.json"
        with pytest.raises(Exception, match="Retrieval is disabled"):
            compile_schema({"type": "object", "properties": {"a": {"$ref": url}}})
        with pytest.raises(TimeoutError):
            server.accept()
    local = {"type": "object", "$defs": {"d": {"type": "string", "format": "date"}},
             "properties": {"a": {"$ref": "#/$defs/d"}}}
    assert not compile_schema(local).is_valid({"a": "soon"})
