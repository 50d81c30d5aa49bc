"""`envelope-proxy check` on policies with HTTP upstreams (`openapi:`): the document is loaded
and validated, tool keys naming no operation are errors at the policy's line, and the
misconfiguration report and weak spots see the document's tools."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.policy import cmd_check

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "openapi"


def _check(tmp_path: Path, tools: dict[str, Any], spec: str = "petstore.yaml",
           defaults: dict[str, Any] | None = None) -> Path:
    policies = tmp_path / "policies"
    policies.mkdir()
    shutil.copy(FIXTURES / spec, policies / spec)
    doc = {"version": 1, "upstreams": {"pets": {"url": "http://127.0.0.1:1", "openapi": spec}},
           "defaults": defaults or {"unknown_tools": "deny"}, "tools": tools}
    # One key per line, so the test knows where each tool key is.
    (policies / "policy.yaml").write_text(json.dumps(doc, indent=2))
    return policies


def _run(policies: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cmd_check(argparse.Namespace(directory=policies, cel_engine=None, strict=False))
    return code, capsys.readouterr().out


def test_petstore_passes_and_its_tools_are_in_the_report(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    policies = _check(tmp_path, {"pets.listPets": {}, "pets.createPets": {"effect": "write"}})
    code, out = _run(policies, capsys)
    assert code == 0, out
    assert out.startswith("ok: ")
    # The document's third operation has no policy under unknown_tools deny: reported as the
    # runtime will refuse it (before, no tools/list was known offline).
    assert "pets.showPetById [registry] unknown_tool" in out


def test_a_tool_key_naming_no_operation_is_an_error_at_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = _check(tmp_path, {"pets.listPets": {}, "pets.deletePet": {"effect": "destructive"}})
    code, out = _run(policies, capsys)
    assert code == 1
    text = (policies / "policy.yaml").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if '"pets.deletePet"' in t)
    [error] = [o for o in out.splitlines() if "deletePet" in o]
    assert error.startswith(f"{policies / 'policy.yaml'}:{line}:")
    assert "names no operation of upstream 'pets'" in error
    assert "listPets, createPets, showPetById" in error


def test_unsupported_parameter_style_is_reported_with_the_documents_position(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = (FIXTURES / "petstore.yaml").read_text().replace(
        "          in: query\n", "          in: query\n          style: deepObject\n", 1)
    policies = _check(tmp_path, {"pets.listPets": {}})
    (policies / "petstore.yaml").write_text(spec)
    code, out = _run(policies, capsys)
    assert code == 1
    [problem] = [o for o in out.splitlines() if "deepObject" in o]
    line = next(i for i, t in enumerate(spec.splitlines(), 1) if "deepObject" in t)
    file, at_line = problem.split(":")[:2]
    assert file.endswith("petstore.yaml") and abs(int(at_line) - line) <= 4, problem


def test_http_weak_spots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = (FIXTURES / "petstore.yaml").read_text().replace(
        "  /pets/{petId}:\n    get:",
        "  /pets/{petId}:\n    delete:\n      operationId: deletePet\n      parameters:\n"
        "        - {name: petId, in: path, required: true, schema: {type: string}}\n"
        "      responses:\n        '204': {description: deleted}\n    get:", 1)
    policies = _check(tmp_path, {"pets.deletePet": {"effect": "write"}, "pets.listPets": {}},
                      defaults={"unknown_tools": "allow"})
    (policies / "petstore.yaml").write_text(spec)
    code, out = _run(policies, capsys)
    assert code == 0, out
    assert "weak spot: tools.pets.deletePet.effect [ungated_destructive]" in out
    assert "weak spot: tools.pets.createPets [writer_without_policy]" in out
    assert "showPetById [writer_without_policy]" not in out  # a GET reads


def test_a_yaml_alias_bomb_is_reported_not_expanded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = _check(tmp_path, {})
    lines = ["openapi: 3.1.0", "info: {title: b, version: '1'}", "x-0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"x-{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    (policies / "petstore.yaml").write_text("\n".join([*lines, "paths: {}"]))
    code, out = _run(policies, capsys)
    assert code != 0
    # At the anchor where the values multiply (x-6: 11 million), not at 1:1.
    assert ("petstore.yaml:9:6: OpenAPI document of upstream 'pets': expands past 2000000 values "
            "once its aliases are expanded") in out
