"""deploy/kubernetes: schema validation (kubernetes-validate), kustomize rendering, wiring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from deploy_helpers import (
    DEPLOY,
    KUBE,
    KUBE_VERSION,
    kustomization_dirs,
    load_yaml,
    load_yaml_docs,
    render_kustomization,
)
from ruamel.yaml import YAML

from proxy.config import load_config

BASE = KUBE / "base"
OVERLAY = KUBE / "overlays" / "replicas-redis"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def _manifest_files() -> list[Path]:
    """Every complete manifest (not kustomizations, not partial patches)."""
    return sorted(p for p in KUBE.rglob("*.yaml")
                  if p.name != "kustomization.yaml" and "patches" not in p.parts)


def _validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(KUBE)))
def test_manifest_validates(path: Path) -> None:
    for doc in load_yaml_docs(path):
        _validate(doc, str(path))


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(KUBE)))
def test_kustomization_renders_and_validates(directory: Path) -> None:
    rendered = render_kustomization(directory)
    assert rendered
    for doc in rendered:
        _validate(doc, f"kustomize build {directory.relative_to(KUBE)}")


def _by_kind(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _by_kind(docs, "Deployment", "envelope-agent")["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = _by_kind(docs, "ConfigMap", "envelope-proxy-config")
    return YAML(typ="safe").load(cm["data"]["config.yaml"])


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in container.get("args", []) if "=" in a)


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "replicas-redis"])
def test_every_container_is_locked_down(directory: Path) -> None:
    for dep in (d for d in render_kustomization(directory) if d["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod.get("automountServiceAccountToken") is False
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert {"requests", "limits"} <= set(c["resources"]), c["name"]
            volumes = {v["name"] for v in pod.get("volumes", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts unknown volume {m['name']}"


def test_base_pod_wiring() -> None:
    docs = render_kustomization(BASE)
    pod = _pod(docs)
    proxy, git_sync, agent = (_container(pod, n) for n in ("envelope-proxy", "git-sync", "agent"))
    # Native sidecars: git-sync and the proxy start (and are ready) before the agent.
    assert [c["name"] for c in pod["initContainers"]] == ["git-sync", "envelope-proxy"]
    assert all(c["restartPolicy"] == "Always" for c in pod["initContainers"])
    assert agent["image"] == "REPLACE_ME/agent"
    assert git_sync["image"].startswith("registry.k8s.io/git-sync/git-sync:v4.")
    # The proxy reads the git-sync symlink: <--root>/<--link>.
    gs = _args(git_sync)
    assert _args(proxy)["policies"] == f"{gs['root']}/{gs['link']}"
    assert "startupProbe" in git_sync and gs["http-bind"].endswith(str(git_sync["startupProbe"]["httpGet"]["port"]))
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    assert mounts["policies"]["mountPath"] == gs["root"] and mounts["policies"]["readOnly"] is True
    assert {m["name"]: m["mountPath"] for m in git_sync["volumeMounts"]}["policies"] == gs["root"]
    # Probes on the admin port.
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    # The config the container really gets: the file, then its env, then its flags.
    env = {e["name"]: e.get("value", "<secret>") for e in proxy["env"]}
    cfg_file = _config(docs)
    config = load_config(None, {"policies": _args(proxy)["policies"]},
                         environ={k: v for k, v in env.items() if k.startswith("ENVELOPE_")})
    assert config.admin_addr[1] == ports["admin"]
    assert config.listen_addr == ("127.0.0.1", 8080)
    assert str(config.state_dir) == mounts["state"]["mountPath"]
    agent_url = {e["name"]: e["value"] for e in agent["env"]}["MCP_SERVER_URL"]
    assert agent_url.startswith(f"http://127.0.0.1:{config.listen_addr[1]}/mcp/")
    # Secrets: approver token env vars and the JWT key file come from Secrets.
    for approver in cfg_file["approvals"]["approvers"].values():
        assert approver["token_env"] in env and env[approver["token_env"]] == "<secret>"
    assert env[cfg_file["approvals"]["in_band_secret_env"]] == "<secret>"
    key_file = Path(cfg_file["identity"]["key_file"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "secret" in volumes[mounts["jwt-key"]["name"]]
    assert key_file.parent == Path(mounts["jwt-key"]["mountPath"])
    assert volumes["config"]["configMap"]["name"] == "envelope-proxy-config"


def test_config_files_load_with_proxy_config() -> None:
    for directory in (BASE, OVERLAY):
        cfg = _config(render_kustomization(directory))
        load_config(None, cfg)


def test_admin_service_and_servicemonitor_select_the_pod() -> None:
    docs = render_kustomization(BASE)
    svc = _by_kind(docs, "Service", "envelope-proxy-admin")
    labels = _by_kind(docs, "Deployment", "envelope-agent")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    proxy_ports = {p["name"] for p in _container(_pod(docs), "envelope-proxy")["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= proxy_ports
    sm = load_yaml(DEPLOY / "prometheus" / "servicemonitor.yaml")
    assert (sm["apiVersion"], sm["kind"]) in CRD_KINDS and sm["metadata"]["name"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in svc_ports and endpoint["path"] == "/metrics"


def test_replicas_redis_overlay() -> None:
    docs = render_kustomization(OVERLAY)
    dep = _by_kind(docs, "Deployment", "envelope-agent")
    assert dep["spec"]["replicas"] == 3
    assert len(dep["spec"]["template"]["spec"]["initContainers"]) == 2, "the patch kept the sidecars"
    cfg = _config(docs)
    assert cfg["store"]["kind"] == "redis"
    redis_svc = _by_kind(docs, "Service", "envelope-redis")
    assert cfg["store"]["url"].startswith(f"redis://{redis_svc['metadata']['name']}:"
                                          f"{redis_svc['spec']['ports'][0]['port']}/")
    assert _by_kind(docs, "Deployment", "envelope-redis")
    pdb = _by_kind(docs, "PodDisruptionBudget", "envelope-agent")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]
    # Only the store differs from the base config.
    base_cfg = _config(render_kustomization(BASE))
    assert {k: v for k, v in cfg.items() if k != "store"} == {k: v for k, v in base_cfg.items() if k != "store"}


def test_prometheusrule_structure() -> None:
    rule = load_yaml(DEPLOY / "prometheus" / "rules.yaml")
    assert (rule["apiVersion"], rule["kind"]) in CRD_KINDS
    assert rule["metadata"]["name"]
    assert rule["spec"]["groups"]
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert {"alert", "expr"} <= set(r) or {"record", "expr"} <= set(r)
