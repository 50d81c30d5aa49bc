"""Approver scopes: which calls an approver may decide (`approvals.approvers.<name>.scope`)."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from proxy.approvals.approvers import Approvers
from proxy.config import ApprovalsConfig, ApproverConfig

DIGEST = hashlib.sha256(b"t").hexdigest()


def _approvers(**scopes: list[str] | None) -> Approvers:
    return Approvers(ApprovalsConfig(approvers={
        name: ApproverConfig(token_sha256=DIGEST, scope=scope) for name, scope in scopes.items()}), environ={})


def test_a_token_of_several_approvers_authenticates_none(caplog: pytest.LogCaptureFixture) -> None:
    """A token two approvers share (one digest copied, or two `token_env` naming one secret) would
    act as whichever the config lists first: a scoped approver's token would decide as an
    unscoped one. It authenticates nobody, and the log says why."""
    config = ApprovalsConfig(approvers={
        "admin": ApproverConfig(token_sha256=DIGEST),
        "carol": ApproverConfig(token_env="CAROL_TOKEN", scope=["notes.delete_*"]),
        "dave": ApproverConfig(token_sha256=hashlib.sha256(b"d").hexdigest(), token_env="DAVE_TOKEN")})
    approvers = Approvers(config, environ={"CAROL_TOKEN": "t", "DAVE_TOKEN": "d"})
    assert approvers.authenticate("t") is None
    assert approvers.authenticate("d") == "dave"  # one approver's two ways to one token
    assert "approvers admin, carol have the same token" in caplog.text


def test_a_scope_names_upstream_dot_tool_patterns() -> None:
    approvers = _approvers(all=None, files=["files.*"], deletes=["*.delete_*", "mail.send"], none=[])
    assert approvers.may_decide("all", "anything", "at_all") and not approvers.scoped("all")
    assert approvers.may_decide("files", "files", "delete_file")
    assert not approvers.may_decide("files", "filesystem", "read")  # the dot is part of the pattern
    assert approvers.may_decide("deletes", "notes", "delete_note") and approvers.may_decide("deletes", "mail", "send")
    assert not approvers.may_decide("deletes", "mail", "send_all") and not approvers.may_decide("deletes", "Notes", "DELETE_x")
    assert not approvers.may_decide("none", "notes", "delete_note") and approvers.scoped("none")
    assert approvers.scope_text("none") == "no call" and approvers.scope_text("all") == "every call"
    assert approvers.scope_text("deletes") == "*.delete_*, mail.send"


def test_each_part_of_a_scope_pattern_matches_its_own_part_of_the_call() -> None:
    """Tool names may hold dots: a glob of the joined `<upstream>.<tool>` let the upstream
    part's `*` or `?` cross the dot, so `*.delete_*` covered `bank`'s `admin.delete_all`."""
    approvers = _approvers(deletes=["*.delete_*"], one=["bank?admin.*"], files=["files.*"])
    assert not approvers.may_decide("deletes", "bank", "admin.delete_all")
    assert not approvers.may_decide("one", "bank", "admin.delete_all")
    assert approvers.may_decide("one", "bank_admin", "admin.delete_all")
    assert approvers.may_decide("deletes", "bank", "delete_x.y")  # the tool's own glob may cross
    assert approvers.may_decide("files", "files", "dir.read")


@pytest.mark.parametrize("pattern", ["github", "", "github .x", ".tool"])
def test_a_scope_pattern_without_upstream_and_tool_is_refused(pattern: str) -> None:
    with pytest.raises(ValidationError, match=r"must be <upstream>\.<tool>"):
        ApproverConfig(token_sha256=DIGEST, scope=[pattern])
