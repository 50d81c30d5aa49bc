"""Argument masking: names and JSON pointers, nested and in arrays, digest of the real args."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from proxy.audit.record import MASKED, args_digest, build_record, mask_arguments
from proxy.policy.model import Defaults, ToolPolicy

ARGS: dict[str, Any] = {
    "secret": "s3cr3t",
    "card": {"number": "4111111111111111", "cvv": "123", "holder": "A"},
    "items": [{"token": "t1", "n": 1}, {"token": "t2", "n": 2}, "plain"],
    "nested": {"deep": {"token": "t3", "keep": True}},
    "a/b": "slash",
    "m~n": "tilde",
    "list": [10, 20, 30],
}


def _build(mask: list[str], log_args: bool = True) -> dict[str, Any]:
    return build_record(
        decision_id="d", revision="r", principal="p", session=None, run="run", upstream="u",
        tool="t", verdict="allow", code="ok", check="forward", rule=None, reason="",
        arguments=ARGS, log_args=log_args, latency={}, upstream_status=200, mask=mask,
    )


def test_top_level_name() -> None:
    out = mask_arguments(ARGS, ["secret"])
    assert out["secret"] == MASKED and out["card"] == ARGS["card"]


def test_name_matches_at_any_depth_and_in_arrays() -> None:
    out = mask_arguments(ARGS, ["token"])
    assert [i["token"] for i in out["items"][:2]] == [MASKED, MASKED]
    assert out["items"][0]["n"] == 1 and out["items"][2] == "plain"
    assert out["nested"]["deep"] == {"token": MASKED, "keep": True}


def test_pointer_nested_object() -> None:
    out = mask_arguments(ARGS, ["/card/number"])
    assert out["card"] == {"number": MASKED, "cvv": "123", "holder": "A"}
    assert out["secret"] == "s3cr3t"


def test_pointer_whole_subtree_and_array_index_and_wildcard() -> None:
    assert mask_arguments(ARGS, ["/card"])["card"] == MASKED
    assert mask_arguments(ARGS, ["/list/1"])["list"] == [10, MASKED, 30]
    out = mask_arguments(ARGS, ["/items/*/token"])
    assert out["items"] == [{"token": MASKED, "n": 1}, {"token": MASKED, "n": 2}, "plain"]
    assert mask_arguments(ARGS, ["/list/*"])["list"] == [MASKED] * 3


def test_pointer_escapes() -> None:
    out = mask_arguments(ARGS, ["/a~1b", "/m~0n"])
    assert out["a/b"] == MASKED and out["m~n"] == MASKED


def test_missing_paths_are_ignored() -> None:
    for m in (["/nope"], ["/card/number/x"], ["/list/9"], ["/list/01"], ["/list/x"], ["nope"]):
        assert mask_arguments(ARGS, m) == ARGS


def test_arguments_are_never_modified() -> None:
    before = copy.deepcopy(ARGS)
    mask_arguments(ARGS, ["secret", "token", "/card/number", "/items/*/n", "/list/0"])
    assert before == ARGS


def test_record_args_masked_digest_of_real_arguments() -> None:
    rec = _build(["/card/number", "secret"])
    assert rec["v"] == 1
    assert rec["args"]["card"]["number"] == MASKED and rec["args"]["secret"] == MASKED
    assert rec["args_digest"] == args_digest(ARGS) == _build([])["args_digest"]
    assert rec["args_digest"] != args_digest(rec["args"])
    assert orjson.loads(orjson.dumps(_build([])))["args"] == ARGS  # unmasked: recorded as is


def test_no_args_without_log_args() -> None:
    assert "args" not in _build(["secret"], log_args=False)


def test_policy_fields() -> None:
    tp = ToolPolicy.model_validate({"log_args": True, "mask": ["/card/number", "secret"]})
    assert tp.mask == ["/card/number", "secret"]
    assert ToolPolicy().mask == [] and Defaults().mask == []
    assert Defaults.model_validate({"mask": ["password"]}).mask == ["password"]
    for bad in ([""], ["/a~2"], "secret"):
        with pytest.raises(ValidationError):
            ToolPolicy.model_validate({"mask": bad})
