"""`proxy/policy/` never imports the envelope: the envelope depends on policy, not back.

Walks the AST of every module under `proxy/policy/` (imports inside functions and
`TYPE_CHECKING` blocks count too) and resolves relative imports against the module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import proxy.policy

POLICY_DIR = Path(proxy.policy.__file__).parent
FORBIDDEN = "proxy.envelope"


def _imported(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`, `from` targets included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            # `from proxy import envelope` imports the envelope as much as `import proxy.envelope`.
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _envelope_imports(source: str, package: str) -> list[str]:
    tree = ast.parse(source)
    return [f"line {line}: {name}" for line, name in _imported(tree, package)
            if name == FORBIDDEN or name.startswith(FORBIDDEN + ".")]


def test_the_walk_sees_every_import_form() -> None:
    """The detector itself: each way of naming the envelope is caught, look-alikes are not."""
    source = (
        "import proxy.envelope.types\n"
        "from proxy.envelope.checks import guardrails\n"
        "from proxy import envelope\n"
        "from .. import envelope as env\n"
        "def f():\n    from proxy.envelope.types import Effect\n"
        "import proxy.envelopes_other\n"
        "from proxy.policy import vocab\n"
    )
    lines = {int(f.split(":")[0].removeprefix("line ")) for f in _envelope_imports(source, "proxy.policy")}
    assert lines == {1, 2, 3, 4, 6}


@pytest.mark.parametrize(
    "path", sorted(POLICY_DIR.rglob("*.py")), ids=lambda p: p.relative_to(POLICY_DIR).as_posix()
)
def test_policy_module_does_not_import_the_envelope(path: Path) -> None:
    relative = path.relative_to(POLICY_DIR.parent.parent).with_suffix("")
    module = ".".join(relative.parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    assert _envelope_imports(path.read_text(encoding="utf-8"), package) == []


def test_the_walk_covers_the_package() -> None:
    """The parametrized test above sees the modules that matter (no silent empty glob)."""
    names = {p.name for p in POLICY_DIR.rglob("*.py")}
    assert {"vocab.py", "model.py", "loader.py", "cel.py", "compiled.py"} <= names
