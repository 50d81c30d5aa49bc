"""The README's YAML examples are real: every ```yaml block loads through the loader that reads
it in production (policy files through `load_policy`, runtime config through `load_config`,
policy test cases through `load_cases`). A block that is only a fragment is marked
`<!-- fragment -->` on the line before its fence and is skipped."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from proxy.config import Config, load_config
from proxy.policy.loader import load_policy
from proxy.policy.model import PolicyDocument
from proxy.tools.policy_tests import load_cases

README = Path(__file__).resolve().parents[2] / "README.md"
# The OpenAPI documents README examples name (`openapi: specs/billing.yaml`), by file name.
OPENAPI_FIXTURES = README.parent / "tests" / "fixtures" / "openapi"
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
FRAGMENT = "<!-- fragment -->"


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    text: str
    fragment: bool


def yaml_blocks(text: str) -> list[Block]:
    """Every ```yaml block of a markdown text, dedented by its fence's indentation."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if lang in ("yaml", "yml"):
            before = lines[start - 1] if start > 0 else ""
            fragment = FRAGMENT in lines[start] or FRAGMENT in before
            blocks.append(Block(start + 1, "\n".join(body) + "\n", fragment))
    return blocks


BLOCKS = yaml_blocks(README.read_text(encoding="utf-8"))
POLICY_KEYS = frozenset(PolicyDocument.model_fields)
CONFIG_KEYS = frozenset(Config.model_fields)


def _kind(data: dict[str, object]) -> str:
    keys = set(data)
    if keys == {"cases"}:
        return "cases"
    if keys <= CONFIG_KEYS and not keys <= POLICY_KEYS:
        return "config"
    if keys <= POLICY_KEYS and not keys <= CONFIG_KEYS:
        return "policy"
    if "version" in keys or keys & {"tools", "principals", "defaults"}:
        return "policy"
    return "config"


def _referenced_upstreams(data: dict[str, object]) -> set[str]:
    """Upstreams a policy excerpt names in its tool, resource and prompt keys."""
    names: set[str] = set()
    for section in ("tools", "resources", "prompts"):
        for key in data.get(section) or {}:  # type: ignore[attr-defined]
            names.add(str(key).split(".", 1)[0])
    for section in ("dataflow",):
        flow = data.get(section) or {}
        for key in (flow.get("declassify") or {}) | (flow.get("on_flag") or {}):  # type: ignore[attr-defined]
            if "." in str(key):
                names.add(str(key).split(".", 1)[0])
    return names


def test_readme_has_yaml_blocks() -> None:
    # A broken fence parser would make every other test here vacuous.
    assert len([b for b in BLOCKS if not b.fragment]) >= 15


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_readme_yaml_block_loads(block: Block, tmp_path: Path) -> None:
    if block.fragment:
        pytest.skip("marked <!-- fragment -->")
    data = YAML(typ="safe").load(block.text)
    assert isinstance(data, dict), f"README.md:{block.line}: not a mapping"
    kind = _kind(data)
    if kind == "cases":
        path = tmp_path / "cases.yaml"
        path.write_text(block.text, encoding="utf-8")
        cases, problems = load_cases([path])
        assert not problems, f"README.md:{block.line}: {problems}"
        assert cases
    elif kind == "config":
        path = tmp_path / "config.yaml"
        path.write_text(block.text, encoding="utf-8")
        load_config(path, environ={})
    else:
        policies = tmp_path / "policies"
        policies.mkdir()
        (policies / "readme.yaml").write_text(block.text, encoding="utf-8")
        # An excerpt names upstreams a real directory declares in another file.
        missing = _referenced_upstreams(data) - set(data.get("upstreams") or {})
        if missing:
            declared = "".join(f"  {n}: {{url: 'http://127.0.0.1:1/mcp'}}\n" for n in sorted(missing))
            (policies / "upstreams.yaml").write_text(f"upstreams:\n{declared}", encoding="utf-8")
        # A document an upstream's `openapi:` names beside the policy: the fixture of that name.
        for entry in (data.get("upstreams") or {}).values():  # type: ignore[attr-defined]
            spec = entry.get("openapi") if isinstance(entry, dict) else None
            if isinstance(spec, str) and not spec.startswith(("http://", "https://")):
                (policies / spec).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(OPENAPI_FIXTURES / Path(spec).name, policies / spec)
        load_policy(policies)


def test_readme_audit_examples_read_where_the_demo_writes() -> None:
    # A newcomer copies these after running the demo: they must name its audit directory.
    demo_audit = f"{Config().state_dir}/audit"
    text = README.read_text(encoding="utf-8")
    commands = re.findall(r"envelope-proxy audit (?:query|tail|verify)[^\n`]*", text)
    assert len(commands) >= 5
    for command in commands:
        words = command.split("#")[0].split()[3:]  # after `envelope-proxy audit <verb>`
        paths = [w for w in words if not w.startswith("-") and ("/" in w or w.startswith("<"))]
        assert paths, command
        assert all(p == demo_audit or p.startswith("<") for p in paths), command


def _commands() -> set[str]:
    """Every command `envelope-proxy --help` offers, with the audit subcommands spelled out."""
    import argparse

    from proxy.cli import build_parser

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    found: set[str] = set()
    for name, parser in subcommands(build_parser()).items():
        nested = subcommands(parser) if name == "audit" else {}
        found |= {f"{name} {sub}" for sub in nested} or {name}
    return found


def test_readme_layout_lists_every_cli_command() -> None:
    text = README.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `proxy/cli/` |"))
    listed = set(re.findall(r"`([a-z]+(?: [a-z]+)?)`", row))
    commands = _commands()
    assert {"serve", "demo", "check", "test", "replay", "approvals", "shadow", "audit verify"} <= commands
    assert commands - listed == set(), f"the Layout row for proxy/cli/ omits {commands - listed}"


def test_cli_help_examples_read_where_the_demo_writes() -> None:
    from proxy.cli import EPILOG

    assert "state/audit" in EPILOG
    assert re.findall(r"(?<![\w.-])state/audit", EPILOG) == []


def test_readme_names_every_environment_variable_serve_reads() -> None:
    # "Running it for real" is where a platform team looks for what it can set from the
    # environment: a variable `load_config` reads and the README never names is a setting nobody
    # finds (ENVELOPE_HEALTH_INTERVAL was one).
    from proxy.config import ENV_KEYS

    running = README.read_text(encoding="utf-8").split("## Running it for real", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(ENVELOPE_[A-Z_]+)`", running))
    missing = sorted({*ENV_KEYS, "ENVELOPE_CONFIG", "ENVELOPE_LISTENER"} - named)
    assert not missing, f"README 'Running it for real' does not name {missing}"
