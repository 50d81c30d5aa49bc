"""deploy/README.md and the main README name files that exist: every repository path either
README shows (in a code span or a shell block) for the deployment is there, so a reader who
copies `kubectl apply -f deploy/prometheus/rules.yaml` finds the file."""

from __future__ import annotations

import re
from pathlib import Path

from deploy_helpers import DEPLOY, REPO

# A relative path in a code span or a command: a directory path, or a name with a file extension.
PATH = re.compile(r"(?<![\w/.:=$-])((?:[\w.-]+/)+[\w.-]*|[\w-]+(?:\.[\w-]+)*\.(?:ya?ml|json|py|md))"
                  r"(?![\w/-])")
CODE = re.compile(r"```sh\n(.*?)```|`([^`\n]+)`", re.S)


def named_paths(text: str) -> set[str]:
    """The relative repository paths a markdown text names in code: not URLs, not absolute paths
    (those are inside a container), not placeholders."""
    found: set[str] = set()
    for block, span in CODE.findall(text):
        for path in PATH.findall(block or span):
            if "://" in path or "REPLACE_ME" in path or "<" in path:
                continue
            found.add(path)
    return found


def resolves(path: str) -> bool:
    """From the repository root, from deploy/, or as the tail of a file under deploy/ (the
    README names `rules.yaml` and `patches/config.yaml` beside their section's directory)."""
    if (REPO / path).exists() or (DEPLOY / path).exists():
        return True
    tail = "/" + path.rstrip("/")
    return any(str(p).endswith(tail) for p in DEPLOY.rglob("*"))


def test_path_scanner_finds_what_readers_copy() -> None:
    # A scanner that found nothing would make the test below vacuous.
    paths = named_paths((DEPLOY / "README.md").read_text(encoding="utf-8"))
    assert {"deploy/prometheus/rules.yaml", "kubernetes/base/secrets.example.yaml",
            "grafana/envelope-dashboard.json", "deploy/kubernetes/overlays/replicas-redis"} <= paths
    assert not any(p.startswith(("/", "http")) for p in paths)
    assert not resolves("proxy/admin/no_such_module.py")


def test_every_path_deploy_readme_names_exists() -> None:
    paths = named_paths((DEPLOY / "README.md").read_text(encoding="utf-8"))
    assert sorted(p for p in paths if not resolves(p)) == []


def test_every_deploy_path_the_main_readme_names_exists() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    # `kubectl logs deploy/envelope-agent` names a Deployment, not a file.
    text = re.sub(r"kubectl \w+ deploy/", "kubectl logs ", text)
    paths = {p for p in named_paths(text) if p.startswith(("deploy/", "tests/deploy/"))}
    assert "deploy/README.md" in paths
    assert sorted(p for p in paths if not resolves(p)) == []


def test_main_readme_layout_points_at_deploy() -> None:
    # Newcomers read the main README; the deployment pieces are found from there.
    text = (REPO / "README.md").read_text(encoding="utf-8")
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert "| `deploy/` |" in layout
    assert Path(REPO / "deploy" / "README.md").exists()
