"""What the program accepts is documented, and what README names is accepted: every policy and
runtime config key (the pydantic models, recursively) is named in README; every flag of every
`envelope-proxy` command has help text in `--help`, and every flag README shows after an
`envelope-proxy <command>` is one that command accepts; every `ENVELOPE_*` / `OTEL_*` variable
the code names is in README or in a `--help`."""

from __future__ import annotations

import argparse
import ast
import re
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from proxy.cli import build_parser
from proxy.config import Config
from proxy.policy.model import PolicyDocument

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


# -- policy and runtime config keys -----------------------------------------------------------


def _models(annotation: object) -> Iterator[type[BaseModel]]:
    """The pydantic models a field's type holds (`dict[str, Tool]`, `Tool | None`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def _keys(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> Iterator[tuple[str, str]]:
    """(dotted path, key) of every field of `model` and of the models below it, each model once."""
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        key = field.alias or name
        yield f"{path}.{key}", key
        for sub in _models(field.annotation):
            yield from _keys(sub, f"{path}.{key}", seen)


def _named(key: str) -> bool:
    """`key` is in README as a code span holding it as a word, or as a YAML key."""
    word = re.escape(key)
    return bool(re.search(rf"`[^`\n]*(?<![\w-]){word}(?![\w-])[^`\n]*`", README)
                or re.search(rf"(?m)^\s*(?:- )?{word}:", README)
                or re.search(rf"[{{,]\s*{word}:", README))


KEYS = [*_keys(PolicyDocument, "policy", set()), *_keys(Config, "config", set())]


def test_key_walk_finds_nested_keys() -> None:
    # A walk that stopped at the top would make the test below vacuous.
    paths = {path for path, _ in KEYS}
    assert {"policy.tools.rules.forbid", "policy.dataflow.on_tainted",
            "config.identity.groups_claim", "config.listener.underscore_headers"} <= paths


@pytest.mark.parametrize("path,key", KEYS, ids=[path for path, _ in KEYS])
def test_every_policy_and_config_key_is_in_readme(path: str, key: str) -> None:
    assert _named(key), f"README never names `{key}` ({path})"


# -- commands and flags -----------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command line prefix (`serve`, `audit verify`, ...) and its parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        found[prefix] = parser
        for name, sub in _subparsers(parser).items():
            walk(f"{prefix} {name}".strip(), sub)

    walk("", build_parser())
    return found


COMMANDS = _commands()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: c or "envelope-proxy")
def test_every_flag_has_help(command: str) -> None:
    parser = COMMANDS[command]
    helpless = [a.option_strings[0] for a in parser._actions if a.option_strings
                and (not a.help or a.help == argparse.SUPPRESS)
                and not re.search(rf"`[^`\n]*{re.escape(a.option_strings[0])}\b", README)]
    assert helpless == [], f"`envelope-proxy {command}`: flags neither in --help nor in README"


# `envelope-proxy <words> ...` in README: the command line up to a comment, a pipe, `&&` or the end
# of the code span or line.
INVOCATION = re.compile(r"envelope-proxy ((?:[a-z]+ ?){1,2})([^`#|&\n]*)")


def _readme_invocations() -> list[tuple[str, str, set[str]]]:
    found = []
    for m in INVOCATION.finditer(README):
        words = m.group(1).split()
        command = next((" ".join(words[:n]) for n in (2, 1) if " ".join(words[:n]) in COMMANDS),
                       None)
        if command is None:
            continue
        tail = (m.group(0).split(" -- ", 1)[0])  # a stdio server's own flags follow `--`
        flags = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", tail))
        found.append((m.group(0).strip(), command, flags))
    return found


def test_readme_invocations_found() -> None:
    invocations = _readme_invocations()
    assert len(invocations) >= 30
    assert any(command == "approvals approve" for _, command, _ in invocations)


def test_every_flag_readme_shows_is_accepted() -> None:
    wrong = []
    for line, command, flags in _readme_invocations():
        accepted = _flags(COMMANDS[command])
        # `approvals list --admin URL`: the options of `approvals` are accepted after its verbs.
        if " " in command:
            accepted |= _flags(COMMANDS[command.split()[0]])
        unknown = flags - accepted
        if unknown:
            wrong.append(f"{line!r}: {sorted(unknown)}")
    assert wrong == []


# -- environment variables --------------------------------------------------------------------

VARIABLE = re.compile(r"(?:ENVELOPE|OTEL)_[A-Z0-9_]*[A-Z0-9]")


def _variables_in_code() -> set[str]:
    """Every `ENVELOPE_*` / `OTEL_*` name that is a string constant in proxy/ (what code reads:
    `environ.get("...")`, a table of names), not one only a comment mentions."""
    names: set[str] = set()
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if VARIABLE.fullmatch(node.value):
                    names.add(node.value)
    return names


def _help_texts() -> str:
    return "\n".join(parser.format_help() for parser in COMMANDS.values())


def test_every_environment_variable_is_documented() -> None:
    names = _variables_in_code()
    assert {"ENVELOPE_CONFIG", "ENVELOPE_APPROVER_TOKEN", "OTEL_SDK_DISABLED"} <= names
    documented = set(VARIABLE.findall(README)) | set(VARIABLE.findall(_help_texts()))
    assert sorted(names - documented) == []


# -- layout -----------------------------------------------------------------------------------


def test_layout_names_every_package_and_module() -> None:
    # A newcomer looking for where something lives starts at the Layout table.
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w./]+)`", layout))
    entries = [p for p in sorted((ROOT / "proxy").iterdir())
               if (p.is_dir() and (p / "__init__.py").exists())
               or (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))]
    missing = []
    for path in entries:
        rel = f"proxy/{path.name}" + ("/" if path.is_dir() else "")
        # A package is named whole or by one of its modules (`proxy/app/runtime.py`).
        if rel not in named and not any(n.startswith(rel) for n in named):
            missing.append(rel)
    assert missing == [], f"README's Layout does not name {missing}"


# -- stated defaults --------------------------------------------------------------------------

UNITS = {"MiB": 2**20, "KiB": 2**10, "s": 1}


def _value(text: str) -> object:
    """`4 MiB` -> 4194304, `10 s` -> 10, `64` -> 64, `drop` -> "drop"."""
    m = re.fullmatch(r"([\d.]+)(?: (MiB|KiB|s))?", text)
    if not m:
        return text
    number = float(m.group(1)) * UNITS[m.group(2) or "s"]
    return int(number) if number.is_integer() else number


def test_limits_table_defaults_are_the_config_defaults() -> None:
    section = README.split("### Limits", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)\.(\w+)` \| ([^|]+?) \|", section, flags=re.M)
    assert len(rows) >= 12
    config = Config()
    wrong = []
    for group, key, stated in rows:
        actual = getattr(getattr(config, group), key)
        if _value(stated) != actual:
            wrong.append(f"{group}.{key}: README {stated!r}, code {actual!r}")
    assert wrong == []


# -- reason codes -----------------------------------------------------------------------------


def test_every_reason_code_is_in_the_refusal_table() -> None:
    # "What a refusal looks like" is where a client author looks up a code they received.
    from proxy.envelope.types import Code

    section = README.split("## What a refusal looks like", 1)[1].split("\n## ", 1)[0]
    in_table = set(re.findall(r"^\| `([a-z_]+)`", section, flags=re.M))
    in_table |= {c for row in re.findall(r"^\| `([a-z_]+)` / `([a-z_]+)`", section, flags=re.M)
                 for c in row}
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert {"unknown_tool", "upstream_timeout"} <= in_table
    refusals = {c.value for c in Code} - {"ok", "replayed", "shadowed"}
    assert sorted(refusals - in_table) == [], "codes the refusal table does not list"
    assert {"ok", "replayed", "shadowed"} <= named


# -- misconfigurations and weak spots -----------------------------------------------------------


def _table_after(heading: str, first_column: str) -> list[list[str]]:
    """The cells of the first table after `heading` whose header starts with `first_column`."""
    section = README.split(heading, 1)[1]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows


def test_misconfiguration_table_is_the_catalogue_rules() -> None:
    from proxy.envelope.checks.catalogue import TOOL_RULES

    rows = _table_after("### Misconfigured tools", "layer")
    documented = {(layer, kind) for layer, kind, *_ in rows}
    # `unknown_tool` is reported (hidden and refused as unknown) without being a tool rule.
    assert documented == {(r.layer, r.id) for r in TOOL_RULES} | {("registry", "unknown_tool")}


def test_weak_spot_table_is_what_check_reports() -> None:
    source = (ROOT / "proxy" / "envelope" / "checks" / "catalogue.py").read_text(encoding="utf-8")
    kinds = {call.args[1].value for call in ast.walk(ast.parse(source))
             if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "WeakSpot"
             and len(call.args) > 1 and isinstance(call.args[1], ast.Constant)}
    assert len(kinds) >= 5
    documented = {row[0] for row in _table_after("### Misconfigured tools", "kind")}
    assert documented == kinds
