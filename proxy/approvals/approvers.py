"""Approver tokens from the runtime config, and who counts as the same person as a call's
principal (`same_person`: the self-approval rule)."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import unicodedata
from collections.abc import Mapping

from proxy.approvals import reveal
from proxy.config import ApprovalsConfig
from proxy.envelope.invisible import visible

log = logging.getLogger("envelope.approvals")


def _as_read(name: str) -> str:
    # NFKC first (fullwidth and other compatibility forms are their letters), invisible
    # characters out, then case-folded and normalised again (folding may leave text that is
    # not normalised, and a removed character may have parted a letter from its accent).
    return unicodedata.normalize("NFKC", visible(unicodedata.normalize("NFKC", name)).casefold()).strip()


def same_person(a: str, b: str) -> bool:
    """Whether names `a` and `b` (an approver's, a call's principal) read as one name: equal once
    NFKC-normalised, case-folded, stripped of invisible characters (`proxy.envelope.invisible`)
    and of whitespace at the ends: `Alice`, `ali\\u200bce` (a zero-width space) and the fullwidth
    `\\uff41lice` are `alice`. The self-approval and self-release rules' comparison: it errs
    toward "the same" (the approver hands the call to a colleague), never toward someone
    deciding their own call."""
    return a == b or _as_read(a) == _as_read(b)


def own_call(approver: str, principal: str, verb: str = "decide", what: str = "a call made by") -> str:
    """The refusal of approver `approver` acting (`verb`) on `what` (a call made by, a run of)
    `principal`, for whom `same_person` holds; the principal escaped (`reveal.visible`: records
    kept before principals were held to `proxy.identity.name_problem` may hold anything)."""
    shown = reveal.visible(principal)
    if approver == principal:
        return f"{approver} cannot {verb} {what} {shown}"
    return (f"{approver} cannot {verb} {what} {shown}: the same name to the self-approval "
            "rule (compared ignoring case, width and invisible characters)")


class Approvers:
    """Approver tokens from the runtime config, checked by SHA-256 digest in constant time."""

    def __init__(self, config: ApprovalsConfig, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self._digests: list[tuple[str, bytes]] = []
        self._scopes: dict[str, tuple[str, ...]] = {
            name: tuple(approver.scope) for name, approver in config.approvers.items() if approver.scope is not None}
        for name, approver in config.approvers.items():
            if approver.token_sha256:
                self._digests.append((name, bytes.fromhex(approver.token_sha256)))
            if approver.token_env:
                token = environ.get(approver.token_env)
                if token:
                    self._digests.append((name, hashlib.sha256(token.encode()).digest()))
                else:
                    log.warning("approver %s: environment variable %s is not set; that token "
                                "cannot authenticate", name, approver.token_env)
        owners: dict[bytes, set[str]] = {}
        for name, digest in self._digests:
            owners.setdefault(digest, set()).add(name)
        for names in owners.values():
            if len(names) > 1:
                log.error("approvers %s have the same token: it authenticates none of them (it "
                          "could not tell a scoped approver from the others)", ", ".join(sorted(names)))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def authenticate(self, token: str | None) -> str | None:
        """The approver's name for this token, or None: no approver's, or several approvers'
        (which one is asking is not known, and their scopes may differ). Every digest is compared."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found: set[str] = set()
        for name, want in self._digests:
            if hmac.compare_digest(digest, want):
                found.add(name)
        return found.pop() if len(found) == 1 else None

    def scoped(self, name: str) -> bool:
        """Whether approver `name` may decide only some calls (`scope` in the config)."""
        return name in self._scopes

    def may_decide(self, name: str, upstream: str, tool: str) -> bool:
        """Whether approver `name` may approve or deny a call of `tool` on `upstream`: unscoped,
        or a pattern of its scope matches (case-sensitive globs). A pattern is `<upstream
        glob>.<tool glob>` split at its first dot (the config holds it to one with no dot
        before it), each glob matching its own part: tool names may hold dots, and a glob of
        the joined `<upstream>.<tool>` let `*.delete_*` (`*` crossing the dot) cover
        `bank`'s `admin.delete_all`."""
        patterns = self._scopes.get(name)
        if patterns is None:
            return True
        for pattern in patterns:
            upstream_glob, dot, tool_glob = pattern.partition(".")
            if (dot and fnmatch.fnmatchcase(upstream, upstream_glob)
                    and fnmatch.fnmatchcase(tool, tool_glob)):
                return True
        return False

    def scope_text(self, name: str) -> str:
        """The approver's scope as the config writes it, for refusals."""
        patterns = self._scopes.get(name)
        return "every call" if patterns is None else (", ".join(patterns) or "no call")
