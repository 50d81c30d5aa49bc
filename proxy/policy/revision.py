"""The revision id of a policy directory: its git commit when it lives in git, else a content hash."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

_GIT_TIMEOUT = 5.0


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_revision(directory: Path) -> str | None:
    """`<12 hex>` of HEAD, plus `-dirty` when the directory has uncommitted changes; None if
    the directory is not in a git work tree with a commit (or git is missing or slow)."""
    inside = _git(directory, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None
    head = _git(directory, "rev-parse", "--short=12", "HEAD")
    if head is None or not head.strip():
        return None
    status = _git(directory, "status", "--porcelain", "--", ".")
    if status is None:
        return None
    return head.strip() + ("-dirty" if status.strip() else "")


def content_revision(directory: Path, files: Iterable[Path]) -> str:
    """`sha256:<12 hex>` over the sorted relative names and bytes of `files`."""
    digest = hashlib.sha256()
    entries = []
    for f in files:
        try:
            rel = f.relative_to(directory).as_posix()
        except ValueError:
            rel = f.as_posix()
        entries.append((rel, f))
    for rel, f in sorted(entries):
        data = f.read_bytes()
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return "sha256:" + digest.hexdigest()[:12]


def policy_revision(directory: Path, files: Iterable[Path]) -> str:
    """The git revision of `directory` when it is inside a git work tree, else its content hash.

    Never raises for git trouble: any git failure falls back to the content hash.
    """
    return git_revision(directory) or content_revision(directory, files)
