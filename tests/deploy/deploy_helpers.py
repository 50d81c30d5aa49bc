"""Shared helpers for the deploy/ tests: YAML loading, a small kustomize renderer, PromQL scans."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
# A Kubernetes version whose schemas ship in kubernetes-validate (native sidecars need 1.29+).
KUBE_VERSION = "1.30.0"
# Labels Prometheus attaches from the target (ServiceMonitor / static_configs), not the proxy.
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance", "container", "service", "endpoint"})


def load_yaml_docs(path: Path) -> list[Any]:
    """Every non-empty YAML document of `path`, as plain dicts and lists."""
    return [d for d in YAML(typ="safe").load_all(path.read_text(encoding="utf-8")) if d is not None]


def load_yaml(path: Path) -> Any:
    docs = load_yaml_docs(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, found {len(docs)}"
    return docs[0]


# -- kustomize, the subset these manifests use --------------------------------------------

SUPPORTED_KUSTOMIZE_KEYS = frozenset({"apiVersion", "kind", "resources", "patches", "labels"})


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge, as far as our patches need it: maps merge, lists of named maps merge by
    `name`, any other value replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in [*base, *patch])):
        out_list = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out_list)}
        for item in patch:
            if item["name"] in index:
                out_list[index[item["name"]]] = _merge(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def resource_key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def render_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build directory` would emit, for the keys in
    `SUPPORTED_KUSTOMIZE_KEYS`. Fails on a missing resource, an unsupported key or a patch whose
    target (kind + name) is not among the resources."""
    kust_path = directory / "kustomization.yaml"
    assert kust_path.is_file(), f"{directory}: no kustomization.yaml"
    kust = load_yaml(kust_path)
    unsupported = set(kust) - SUPPORTED_KUSTOMIZE_KEYS
    assert not unsupported, f"{kust_path}: keys the test renderer does not model: {sorted(unsupported)}"
    assert kust.get("kind") == "Kustomization", kust_path
    out: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{kust_path}: resource {entry} does not exist"
        if target.is_dir():
            out.extend(render_kustomization(target))
        else:
            assert target.is_relative_to(directory.resolve()), (
                f"{kust_path}: {entry} is outside the kustomization root (kustomize refuses it)")
            out.extend(load_yaml_docs(target))
    keys = [resource_key(d) for d in out]
    assert len(keys) == len(set(keys)), f"{kust_path}: duplicate resources {keys}"
    for patch_entry in kust.get("patches", []):
        assert set(patch_entry) == {"path"}, f"{kust_path}: only `path:` patches are modelled"
        patch_path = directory / patch_entry["path"]
        assert patch_path.is_file(), f"{kust_path}: patch {patch_entry['path']} does not exist"
        for patch in load_yaml_docs(patch_path):
            key = resource_key(patch)
            assert key in keys, f"{patch_path}: patch target {key} is not a resource of {directory}"
            i = keys.index(key)
            assert out[i]["apiVersion"] == patch["apiVersion"], f"{patch_path}: apiVersion differs"
            out[i] = _merge(out[i], patch)
    for label_set in kust.get("labels", []):
        assert set(label_set) <= {"pairs"}, f"{kust_path}: only labels.pairs is modelled"
        for doc in out:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(label_set["pairs"])
    return out


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


# -- PromQL ----------------------------------------------------------------------------------

_METRIC = re.compile(r"\b(envelope_[a-zA-Z0-9_]+)\b(\s*\{([^}]*)\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_refs(expr: str, histograms: set[str]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric family name, [(label, op, value)]) for every `envelope_*` name in `expr`;
    histogram series suffixes are stripped when the base name is a histogram."""
    refs = []
    for m in _METRIC.finditer(expr):
        name = m.group(1)
        for suffix in _HIST_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in histograms:
                name = name[: -len(suffix)]
                break
        refs.append((name, _MATCHER.findall(m.group(3) or "")))
    return refs


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)` / `without (...)` clauses."""
    labels: set[str] = set()
    for m in _GROUPING.finditer(expr):
        labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
    return labels
