"""The stdio front's lifecycle: the proxy on a private loopback listener, one bridge in front.

`serve_stdio` loads the policy, starts the runtime with its MCP listener on loopback (an
ephemeral port, every request required to carry this process's random credential), no admin
listener unless asked, and relays the client's stdin and stdout to `/mcp/<upstream>` through
`proxy.fronts.stdio.StdioBridge` until stdin ends or SIGTERM / SIGINT arrives; then the runtime
stops in its usual order (in-flight calls completed and audited, upstreams and children closed,
the audit log flushed). SIGHUP reloads the policy.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
from typing import BinaryIO
from urllib.parse import quote

from proxy.app.runtime import Runtime
from proxy.config import Config
from proxy.errors import AuditError, ConfigError, ListenError, PolicyError
from proxy.fronts.stdio import StdioBridge, credential_middleware

log = logging.getLogger("envelope.stdio")

__all__ = ["serve_stdio"]


async def serve_stdio(config: Config, upstream: str, stdin: BinaryIO, stdout: BinaryIO,
                      admin: bool = False) -> int:
    """Serve one stdio client in front of `upstream`. Returns the exit status: 2 when the policy
    is invalid, does not declare `upstream`, the runtime cannot be set up (an identity key
    file, the audit log) or a listener cannot bind (logged on stderr);
    0 after the client closed stdin (or a signal) and the runtime stopped."""
    try:
        runtime = Runtime(config)
    except (ConfigError, AuditError) as exc:
        log.error("%s", exc)
        return 2
    try:
        runtime.load_policy()
    except PolicyError as exc:
        for problem in exc.problems:
            log.error("%s", problem)
        log.error("policy directory %s is invalid: not starting", config.policies)
        return 2
    if runtime.target(upstream) is None:
        log.error("the policy in %s declares no upstream %r (its tools are keyed %s.<tool>): "
                  "add it under `upstreams:` or choose another name with --name",
                  config.policies, upstream, upstream)
        await runtime.stop(quiet=True)
        return 2
    secret = secrets.token_urlsafe(32)
    try:
        await runtime.start(admin=admin, mcp_middlewares=[credential_middleware(secret)])
    except ListenError as exc:
        await runtime.stop(quiet=True)
        log.error("%s", exc)
        return 2
    host, _ = config.listen_addr
    url = f"http://{host}:{runtime.mcp_port}/mcp/{quote(upstream, safe='')}"
    limits = config.limits
    bridge = StdioBridge(url, secret, stdin, stdout, max_message_bytes=limits.max_body_bytes,
                         max_event_bytes=limits.max_upstream_event_bytes,
                         drain_seconds=config.shutdown_grace)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(runtime.reload("SIGHUP")))
    log.debug("the bridge's listener: %s (requests without this process's credential get 403)",
              url)
    revision = runtime.revision.revision if runtime.revision else "none"
    log.info("envelope-proxy %s: stdio front for upstream %r ready%s", revision, upstream,
             f"; admin {runtime.urls['admin']}" if "admin" in runtime.urls else "")
    try:
        await bridge.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await runtime.stop()
    return 0
