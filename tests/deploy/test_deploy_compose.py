"""deploy/compose.yaml: parses, references existing files, ports agree with the proxy config."""

from __future__ import annotations

from typing import Any

from deploy_helpers import DEPLOY, REPO, load_yaml

from proxy.config import load_config

COMPOSE = DEPLOY / "compose.yaml"


def _compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def _container_env(service: dict[str, Any]) -> dict[str, str]:
    """The image's ENVELOPE_* defaults (deploy/Dockerfile) overlaid with the service's."""
    from test_deploy_dockerfile import _env, _stages

    env = {k: v for k, v in _env(_stages()[-1][1]).items() if k.startswith("ENVELOPE_")}
    env.update({k: str(v) for k, v in service.get("environment", {}).items()})
    return env


def test_services_and_build() -> None:
    services = _compose()["services"]
    assert {"proxy", "demo", "redis", "prometheus"} <= set(services)
    build = services["proxy"]["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == REPO
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).is_file()
    # The demo server runs from the same image.
    assert services["demo"]["image"] == services["proxy"]["image"]
    assert services["demo"]["entrypoint"][:3] == ["python", "-m", "proxy.examples.demo_server"]
    assert services["proxy"]["read_only"] is True


def test_bind_mounts_exist() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith((".", "/")):
                assert (COMPOSE.parent / src).exists(), f"{name}: {src} does not exist"


def _mount_source(service: dict[str, Any], target: str) -> str:
    for volume in service.get("volumes", []):
        src, dst = volume.split(":")[:2]
        if dst == target:
            return src
    raise AssertionError(f"nothing mounted at {target}")


def test_ports_agree_with_proxy_config() -> None:
    services = _compose()["services"]
    proxy = services["proxy"]
    command = proxy["command"]
    config_path = command[command.index("--config") + 1]
    config_file = COMPOSE.parent / _mount_source(proxy, config_path)
    env = _container_env(proxy)
    config = load_config(config_file, environ=env)
    published = {int(p.split(":")[-1]) for p in proxy["ports"]}
    assert {config.listen_addr[1], config.admin_addr[1]} == published
    assert config.listen_addr[0] == "0.0.0.0"
    assert "proxy" in config.allowed_hosts, "in-network clients use the Host name `proxy`"
    # The policies mount is what ENVELOPE_POLICIES names, and it holds the demo upstream.
    assert (COMPOSE.parent / _mount_source(proxy, str(config.policies))).is_dir()
    # Upstream URL -> the demo service and its port.
    demo = services["demo"]
    demo_port = demo["command"][demo["command"].index("--port") + 1]
    assert config.upstreams["demo"].url == f"http://demo:{demo_port}/mcp"
    assert demo_port in [str(p) for p in demo.get("expose", [])]
    # Redis store -> the redis service.
    assert config.store.kind == "redis" and config.store.url.startswith("redis://redis:6379/")
    # Prometheus scrapes the admin port and loads the project's rules.
    prom_cfg = load_yaml(COMPOSE.parent / _mount_source(services["prometheus"], "/etc/prometheus/prometheus.yml"))
    targets = [t for job in prom_cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"proxy:{config.admin_addr[1]}" in targets
    for rule_file in prom_cfg["rule_files"]:
        assert (COMPOSE.parent / _mount_source(services["prometheus"], rule_file)).is_file()
