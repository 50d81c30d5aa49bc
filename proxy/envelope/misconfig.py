"""Misconfigurations: tools that can never run, one shape for every sink.

The catalogue (`proxy.envelope.checks.catalogue`) decides what is misconfigured, with an ordered list of
rules; this module holds the shared shape (`Misconfiguration`), what the envelope layer depends
on (`Dependencies`) and the one sink (`MisconfigSink`) that turns a report into a log line per
problem (once per revision), the `envelope_misconfigured_tools{layer}` gauge and the list served
by `GET /v1/misconfigurations`. `envelope-proxy check` prints the same objects.

Layers: `registry` — the policy and the upstreams' catalogues disagree (a tool its upstream does
not offer, an undeclared upstream, an upstream tool with no policy, a fallback deny with no allow
rule); `envelope` — the policy needs a runtime dependency that is missing (an approval gate, an
idempotency store, a shadow recorder).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from proxy.envelope.types import Services

log = logging.getLogger("envelope")

Layer = Literal["registry", "envelope"]
LAYERS: tuple[Layer, ...] = get_args(Layer)

# The tool of a problem that concerns every tool of one principal (shadow mode, no recorder).
EVERY_TOOL = "*"


@dataclass(frozen=True, slots=True)
class Misconfiguration:
    """One reason a tool can never run.

    `tool` is the policy key `<upstream>.<tool>` (or `*` with `principal` set: every writer tool
    of that principal); `kind` is the stable id of the rule that found it; `reason` is what the
    refusal and the log say.
    """

    tool: str
    layer: Layer
    kind: str
    reason: str
    principal: str | None = None

    @property
    def rule(self) -> str:
        """The policy path the refusal names (the `rule` of the decision)."""
        if self.principal == "*":  # every principal the policy does not list
            return "defaults"
        if self.principal is not None:
            return f"principals.{self.principal}"
        if self.kind == "unknown_tool":
            return "defaults.unknown_tools"
        return f"tools.{self.tool}"

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "tool": self.tool, "layer": self.layer, "kind": self.kind, "reason": self.reason,
        }
        if self.principal is not None:
            data["principal"] = self.principal
        return data


def _approval_check_built() -> bool:
    # An approval gate exists only when the chain has an `approval` check; imported late because
    # the pipeline imports the catalogue.
    from proxy.envelope import pipeline

    return any(getattr(cls, "id", None) == "approval" for cls in pipeline.CHECKS)


@dataclass(frozen=True, slots=True)
class Dependencies:
    """What the envelope layer of the process provides, decided once per chain.

    `store` is the state store's kind (None: no store, so no approval gate, no idempotency store
    and no shadow recorder); `approvals_enabled` the runtime switch; `approval_check` whether the
    chain has an approval check at all.
    """

    store: str | None
    approvals_enabled: bool = True
    approval_check: bool = False

    @classmethod
    def of(cls, services: Services | None) -> Dependencies:
        """The dependencies a process's `Services` provide (None: none at all)."""
        store = services.store if services is not None else None
        return cls(
            store=store.kind if store is not None else None,
            approvals_enabled=services.settings.approvals.enabled if services is not None else True,
            approval_check=_approval_check_built(),
        )

    @classmethod
    def default_runtime(cls) -> Dependencies:
        """What `envelope-proxy serve` provides with no config: a sqlite store, approvals on."""
        return cls(store="sqlite", approvals_enabled=True, approval_check=_approval_check_built())

    def describe(self) -> str:
        store = f"{self.store} store" if self.store else "no store"
        approvals = "approvals enabled" if self.approvals_enabled else "approvals disabled"
        return f"{store}, {approvals}"


def count_by_layer(problems: Iterable[Misconfiguration]) -> dict[Layer, int]:
    """Distinct misconfigured tools per layer (a tool with two problems in a layer counts once)."""
    seen: dict[Layer, set[tuple[str, str | None]]] = {layer: set() for layer in LAYERS}
    for p in problems:
        seen[p.layer].add((p.tool, p.principal))
    return {layer: len(tools) for layer, tools in seen.items()}


class MisconfigSink:
    """The one place a misconfiguration report goes: log, gauge, admin list.

    `publish` is called at every policy load (after `loaded`) and whenever the registry learns a
    `tools/list`; each problem is logged once per load (a warning), the gauge and the admin list
    always show the current report.
    """

    def __init__(self, metrics: Any = None) -> None:
        self._metrics = metrics
        self._logged: set[Misconfiguration] = set()
        self.current: tuple[Misconfiguration, ...] = ()

    def loaded(self) -> None:
        """A policy revision was (re)loaded: its problems are logged again, once each."""
        self._logged = set()

    def publish(self, problems: Iterable[Misconfiguration]) -> None:
        """Make `problems` the current report; log the ones not logged since the last load."""
        report = tuple(problems)
        for p in report:
            if p not in self._logged:
                self._logged.add(p)
                who = f" (principal {p.principal})" if p.principal is not None else ""
                log.warning("misconfigured tool %s%s [%s, %s]: %s; calls to it are refused",
                            p.tool, who, p.layer, p.kind, p.reason)
        self.current = report
        if self._metrics is not None:
            self._metrics.set_misconfigured(count_by_layer(report))

    def as_json(self) -> list[dict[str, Any]]:
        return [p.as_json() for p in self.current]
