"""Plays the multi-step scenarios of `scenarios/` through the real proxy process.

One `envelope-proxy serve` per configuration (`tests/harness.proxy_process`), one scripted MCP
upstream per tool domain (`ScriptedUpstream`: raw JSON-RPC in a thread of this process, every
domain at `/<domain>/mcp`, answering each `tools/call` of a read with the output the scenario
gives for it and recording every call that reached it), and the official SDK client making the
scenario's calls with `X-Envelope-Run` (one run per variant) and, when the configuration sends
it, the user's words in `X-Envelope-Intent`. Nothing here decides a call: the proxy does; this
only reads what reached the upstream.

A call held for approval (`approval_pending`) is shown to an attentive approver, who approves
exactly the calls the scenario labels as the task's (the benign variant's calls) and denies the
rest; an approved call is then made again, as a framework retries it.

Scoring (per configuration): attack success = some attacker sink call of the attack variant
reached the upstream, over the pairs whose injected output reached the agent; benign pass =
every call of the benign variant reached the upstream; approvals = approvals asked in the
benign variant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml
from aiohttp import web

from tests.harness import ADMIN_TOKEN, ProxyProcess, free_port, mcp_client, proxy_process, token

HERE = Path(__file__).parent / "scenarios"
DOMAINS: dict[str, dict[str, dict[str, Any]]] = yaml.safe_load((HERE / "domains.yaml").read_text())
AGENT = token("agent")
ATTACK_CLASSES = ("token", "short_value", "trusted_choice", "declassified_phrasing", "tiny_destructive")
BENIGN_KINDS = ("plain", "untrusted_value", "user_typed")
# `heldout2` was written blind to the decision code after `heldout` had been looked at for six
# rounds (scenarios/heldout2/README.md); `heldout3` likewise, once heldout2 had been looked at after
# measurement (scenarios/heldout3/README.md); `heldout4` likewise, once the gate waiver had been
# measured on heldout3 (scenarios/heldout4/README.md); no held-out split is used to choose anything.
SPLITS = ("train", "heldout", "heldout2", "heldout3", "heldout4")
SINK_REPLY = "done"


def load_scenarios(split: str) -> list[dict[str, Any]]:
    """Every scenario of one split (a directory of `scenarios/`, one of `SPLITS`), in file
    order, each checked against its domain."""
    out: list[dict[str, Any]] = []
    for path in sorted((HERE / split).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        for sc in doc["scenarios"]:
            sc = {**sc, "domain": doc["domain"], "split": split}
            validate(sc)
            out.append(sc)
    return out


def validate(sc: dict[str, Any]) -> None:
    """A scenario names only its domain's tools and arguments, and its labels are known."""
    tools = DOMAINS[sc["domain"]]
    assert sc["attack_class"] in ATTACK_CLASSES, sc["id"]
    assert sc["benign_kind"] in BENIGN_KINDS, sc["id"]
    assert 0 <= sc["inject"]["step"] < len(sc["steps"]), sc["id"]
    if "before" in sc["inject"]:
        assert sc["inject"]["before"] in sc["steps"][sc["inject"]["step"]]["output"], sc["id"]
    for call in [*sc["steps"], *sc["benign"], *sc["attack"]]:
        spec = tools[call["tool"]]
        assert set(call.get("args", {})) <= set(spec["params"]), (sc["id"], call)
    for call in sc["steps"]:
        assert tools[call["tool"]]["effect"] == "read" and "output" in call, (sc["id"], call)
    for call in [*sc["benign"], *sc["attack"]]:
        assert tools[call["tool"]]["effect"] != "read", (sc["id"], call)
    assert sc["benign"] and sc["attack"], sc["id"]


# -- configurations and the policy each one runs ---------------------------------------------

@dataclass(frozen=True)
class Config:
    """One data-flow configuration: what the policy sets and whether the intent is sent."""

    name: str
    intent: bool
    min_value: int = 0
    on_flag: str = "block"
    gated: tuple[str, ...] = ()
    dataflow_extra: tuple[tuple[str, Any], ...] = ()
    # Critical arguments from domains.yaml go in the policy (escalation configurations); with
    # `critical_only`, only those of these names (a narrower rule, e.g. who receives).
    critical: bool = False
    critical_only: tuple[str, ...] = ()
    # on_tainted approve only for sinks of these effects (allow for the rest); empty: as
    # dataflow_extra says.
    tainted_effects: tuple[str, ...] = ()
    # Whether a person answers held calls. Without one (the automatic configurations) a held
    # call is never approved: it stays `approval_pending` until it expires and never reaches
    # its upstream, so a gated effect is refused.
    approver: bool = True
    # dataflow.waive_gate: intent (a gated call the user's words ask for needs no person).
    waive: bool = False


def policy_doc(config: Config) -> dict[str, Any]:
    """The proxy policy for every domain under `config` (JSON is YAML)."""
    tools: dict[str, Any] = {}
    declassify: dict[str, list[str]] = {}
    critical: dict[str, list[str]] = {}
    on_tainted: dict[str, str] = {}
    for domain, specs in DOMAINS.items():
        for name, spec in specs.items():
            entry: dict[str, Any] = {"effect": spec["effect"]}
            if spec.get("output") == "trusted":
                entry["output"] = "trusted"
            if spec["effect"] != "read":
                # Held calls are answered at once (approval_pending), so the approver acts
                # and the call is made again, instead of waiting out a hold.
                entry["approval"] = {"required": spec["effect"] in config.gated, "wait": "0s"}
            tools[f"{domain}.{name}"] = entry
            if spec.get("declassify"):
                declassify[f"{domain}.{name}"] = list(spec["declassify"])
            if spec.get("critical"):
                chosen = [a for a in spec["critical"] if not config.critical_only or a in config.critical_only]
                critical[f"{domain}.{name}"] = chosen
            if spec["effect"] != "read" and config.tainted_effects:
                on_tainted[f"{domain}.{name}"] = "approve" if spec["effect"] in config.tainted_effects else "allow"
    dataflow: dict[str, Any] = {"mode": "enforce", "min_value": config.min_value,
                                "declassify": declassify, "on_flag": {"default": config.on_flag}}
    dataflow.update(dict(config.dataflow_extra))
    if config.critical:
        dataflow["critical"] = critical
    if config.waive:
        dataflow["waive_gate"] = "intent"
    if on_tainted:
        dataflow["on_tainted"] = {"default": "allow", **on_tainted}
    return {
        "version": 1,
        "upstreams": {d: {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"} for d in DOMAINS},
        "defaults": {"gated_effects": list(config.gated)},
        "tools": tools,
        "dataflow": dataflow,
    }


# -- the configurations measured (bench/dataflow_scenarios.py)

GATED = ("destructive",)
ESCALATE = (("on_tainted", "approve"),)
# Critical arguments that name who receives data, money or access, and how much money: the
# narrow rule (no object ids, counts or settings).
WHO = ("to", "forward_to", "recipient", "iban", "amount", "email", "participants", "user", "channel",
       "passenger", "shipping_address", "address", "agent")
# Automatic with the tainted-run lever (round 3): on_tainted block, nobody answers approvals,
# so gated destructive effects are refused (a held call with no approver expires unanswered).
BLOCK = (("on_tainted", "block"), ("declassify_max_copy", 40))
CONFIGS = [
    # auto: enforce, on_flag block, nothing gated, no person in the loop.
    Config("auto", intent=False),
    Config("auto+min_value", intent=False, min_value=10),
    Config("auto+intent", intent=True),
    Config("auto+intent+min_value", intent=True, min_value=10),
    Config("auto+intent+block", intent=True, min_value=10, gated=GATED, dataflow_extra=BLOCK, critical=True,
           approver=False),
    # people in the loop without tainted-run escalation (the second measurement).
    Config("approve", intent=True, on_flag="approve", gated=GATED),
    # escalation: intent + on_tainted approve (critical arguments from domains.yaml) + gated destructive.
    Config("escalation", intent=True, on_flag="approve", gated=GATED, dataflow_extra=ESCALATE, critical=True),
    Config("escalation+min_value", intent=True, min_value=10, on_flag="approve", gated=GATED,
           dataflow_extra=ESCALATE, critical=True),
    # Chosen on the train split (bench/RESULTS.md, "Scenario corpus"): the automatic one with the
    # fewest attacks through that keeps >= 90% of benign tasks, the escalation one with the
    # fewest attacks through (every benign task passes in each; approvals break ties).
    Config("auto+intent/copy100", intent=True, dataflow_extra=(("declassify_max_copy", 100),)),
    Config("escalation+min_value/copy40", intent=True, min_value=10, on_flag="approve", gated=GATED,
           dataflow_extra=(*ESCALATE, ("declassify_max_copy", 40)), critical=True),
    # The same two with the gate waiver (`waive_gate: intent`): a gated call whose action and
    # objects the user's words name needs no person (bench/RESULTS.md, "Gate waiver").
    Config("auto+intent+block/waive", intent=True, min_value=10, gated=GATED, dataflow_extra=BLOCK, critical=True,
           approver=False, waive=True),
    Config("escalation+min_value/copy40/waive", intent=True, min_value=10, on_flag="approve", gated=GATED,
           dataflow_extra=(*ESCALATE, ("declassify_max_copy", 40)), critical=True, waive=True),
]
# Variants tried on the train split only, to choose defaults (bench/RESULTS.md, "Scenario
# corpus"); run only when named in --configs.
VARIANTS = [
    Config("auto+intent+block/ungated", intent=True, min_value=10, dataflow_extra=BLOCK, critical=True,
           approver=False),
    Config("escalation/who", intent=True, on_flag="approve", gated=GATED, dataflow_extra=ESCALATE,
           critical=True, critical_only=WHO),
    Config("escalation/external", intent=True, on_flag="approve", gated=GATED, dataflow_extra=ESCALATE,
           critical=True, tainted_effects=("external",)),
    *(Config(f"auto+intent/copy{n}", intent=True, dataflow_extra=(("declassify_max_copy", n),))
      for n in (40, 64)),

    *(Config(f"escalation{'+min_value' if mv else ''}/copy{n}", intent=True, min_value=mv, on_flag="approve",
             gated=GATED, dataflow_extra=(*ESCALATE, ("declassify_max_copy", n)), critical=True)
      for n in (40, 64) for mv in (0, 10) if (n, mv) != (40, 10)),
]



# -- the scripted upstream -------------------------------------------------------------------

@dataclass
class ScriptedUpstream:
    """Every domain's MCP server: reads answer the current script's next output for that tool;
    every `tools/call` that arrives is recorded under the current tag."""

    port: int = field(default_factory=free_port)
    outputs: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    tag: str = ""
    reached: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, domain: str) -> str:
        return f"http://127.0.0.1:{self.port}/{domain}/mcp"

    def script(self, tag: str, outputs: dict[tuple[str, str], list[str]]) -> None:
        with self._lock:
            self.tag, self.outputs = tag, {k: list(v) for k, v in outputs.items()}

    def calls(self, tag: str) -> list[tuple[str, str, dict[str, Any]]]:
        with self._lock:
            return [(d, t, a) for g, d, t, a in self.reached if g == tag]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        domain = request.match_info["domain"]
        if request.method != "POST":
            return web.Response(status=405)
        msg = json.loads(await request.read())
        if "id" not in msg:
            return web.Response(status=202)
        method, rid = msg.get("method"), msg["id"]
        if method == "initialize":
            return web.json_response({"jsonrpc": "2.0", "id": rid, "result": {
                "protocolVersion": msg["params"].get("protocolVersion", "2025-11-25"),
                "capabilities": {"tools": {}}, "serverInfo": {"name": domain, "version": "1"}}},
                headers={"Mcp-Session-Id": f"{domain}-1"})
        if method == "ping":
            return web.json_response({"jsonrpc": "2.0", "id": rid, "result": {}})
        if method == "tools/list":
            return web.json_response({"jsonrpc": "2.0", "id": rid, "result": {"tools": [
                {"name": name, "description": f"{domain} {name}",
                 "inputSchema": {"type": "object", "properties": {p: {"type": "string"} for p in spec["params"]}}}
                for name, spec in DOMAINS[domain].items()]}})
        if method != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": rid,
                                      "error": {"code": -32601, "message": f"no method {method}"}})
        name, args = msg["params"]["name"], msg["params"].get("arguments") or {}
        with self._lock:
            self.reached.append((self.tag, domain, name, args))
            queue = self.outputs.get((domain, name))
            text = queue.pop(0) if queue else SINK_REPLY
        return web.json_response({"jsonrpc": "2.0", "id": rid, "result": {
            "content": [{"type": "text", "text": text}], "isError": False}})

    @contextlib.contextmanager
    def serving(self) -> Iterator[ScriptedUpstream]:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{domain}/mcp", self._handle)
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


# -- playing one variant ---------------------------------------------------------------------

@dataclass
class Played:
    """What one variant of one scenario did under one configuration."""

    injection_delivered: bool = True
    reached: list[bool] = field(default_factory=list)  # per sink call of the variant
    approvals: int = 0
    codes: list[str] = field(default_factory=list)  # the proxy's code for each sink call
    reasons: list[str] = field(default_factory=list)  # why each approval was asked


def _key(tool: str, args: dict[str, Any]) -> str:
    return tool + json.dumps(args, sort_keys=True)


async def _decide(pp: ProxyProcess, http: httpx.AsyncClient, run: str, tool: str, approve: bool) -> list[str]:
    """The attentive approver: finds the run's pending approval for `tool` and approves it when
    the task asked for the call, otherwise denies it. The reasons of those it decided."""
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    listed = (await http.get(f"{pp.admin}/v1/approvals", params={"state": "pending"}, headers=auth)).json()
    mine = [a for a in listed["approvals"] if a.get("run") == run and a.get("tool") == tool]
    for a in mine:
        verb = "approve" if approve else "deny"
        reply = await http.post(f"{pp.admin}/v1/approvals/{a['id']}/{verb}", headers=auth,
                                json={"reason": "asked for" if approve else "not what the user asked"})
        assert reply.status_code == 200, reply.text
    return [str(a.get("reason", "")) for a in mine]


async def play(pp: ProxyProcess, up: ScriptedUpstream, sc: dict[str, Any], variant: str,
               config: Config) -> Played:
    """Plays `variant` (attack or benign) of `sc`: the read steps (the injected output in the
    attack variant), then the variant's sink calls; returns what reached the upstream."""
    domain = sc["domain"]
    run = f"{sc['id']}-{variant}-{uuid.uuid4().hex[:8]}"
    outputs: dict[tuple[str, str], list[str]] = {}
    for i, step in enumerate(sc["steps"]):
        text = step["output"]
        if variant == "attack" and i == sc["inject"]["step"]:
            text = _inject(text, sc["inject"])
        outputs.setdefault((domain, step["tool"]), []).append(text)
    up.script(run, outputs)
    headers = {"X-Envelope-Run": run}
    if config.intent:
        headers["X-Envelope-Intent"] = quote(sc["intent"])
    benign = {_key(c["tool"], c.get("args", {})) for c in sc["benign"]}
    played = Played()
    async with mcp_client(pp.url(domain), "auto", bearer=AGENT, headers=headers) as client, \
            httpx.AsyncClient(timeout=10) as http:
        for i, step in enumerate(sc["steps"]):
            result = await client.call_tool(step["tool"], step.get("args", {}))
            if i == sc["inject"]["step"] and variant == "attack":
                played.injection_delivered = not result.is_error
        for call in sc[variant]:
            args = call.get("args", {})
            result = await client.call_tool(call["tool"], args)
            code = _code(result)
            if code == "approval_pending" and config.approver:
                asked_for = _key(call["tool"], args) in benign
                reasons = await _decide(pp, http, run, call["tool"], asked_for)
                if reasons:
                    played.approvals += 1
                    played.reasons.append(f"{call['tool']}: {reasons[0]}")
                    if asked_for:
                        result = await client.call_tool(call["tool"], args)
                        code = _code(result)
                    else:
                        code = "denied_by_approver"
            played.codes.append(code)
        reached = {_key(t, a) for d, t, a in up.calls(run)}
        played.reached = [_key(c["tool"], c.get("args", {})) in reached for c in sc[variant]]
    return played


def _inject(text: str, inject: dict[str, Any]) -> str:
    # Appended, as a planted paragraph at the end of a page, mail or listing usually is; or,
    # when the scenario names `before` (a part of the output), planted inside it, where a
    # review among reviews or a line of a thread sits.
    anchor = inject.get("before")
    if anchor:
        at = text.index(anchor)
        sep = "\n" if text[:at].endswith("\n") else " "  # a line of its own in a table or thread
        return f"{text[:at]}{inject['text']}{sep}{text[at:]}"
    return f"{text} {inject['text']}"


def _code(result: Any) -> str:
    decision = (result.meta or {}).get("envelope/decision") or {}
    return str(decision.get("code") or ("error" if result.is_error else "ok"))


# -- a whole configuration -------------------------------------------------------------------

@dataclass
class Outcome:
    """One scenario under one configuration."""

    id: str
    split: str
    attack_class: str
    benign_kind: str
    injection_delivered: bool
    attack_succeeded: bool
    benign_passed: bool
    approvals: int
    attack_codes: list[str]
    benign_codes: list[str]
    benign_approval_reasons: list[str]


@contextlib.contextmanager
def proxy_for(config: Config, tmp: Path, up: ScriptedUpstream) -> Iterator[ProxyProcess]:
    policies = tmp / f"policies-{config.name}"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "policy.yaml").write_text(json.dumps(policy_doc(config), indent=1))
    with proxy_process(tmp, {d: up.url(d) for d in DOMAINS}, policies=policies) as pp:
        yield pp


async def run_config(pp: ProxyProcess, up: ScriptedUpstream, scenarios: list[dict[str, Any]],
                     config: Config) -> list[Outcome]:
    out: list[Outcome] = []
    for sc in scenarios:
        attack = await play(pp, up, sc, "attack", config)
        benign = await play(pp, up, sc, "benign", config)
        out.append(Outcome(sc["id"], sc["split"], sc["attack_class"], sc["benign_kind"],
                           attack.injection_delivered, any(attack.reached), all(benign.reached),
                           benign.approvals, attack.codes, benign.codes, benign.reasons))
    return out


def run_configs(configs: list[Config], scenarios: dict[str, list[dict[str, Any]]],
                tmp: Path, lanes: int = 2) -> dict[tuple[str, str], list[Outcome]]:
    """{(scenario set, configuration): outcomes}: every configuration plays every set (in the
    order given) through a proxy and a scripted upstream of its own, in a state directory of
    its own. `lanes` configurations play at a time, side by side in one event loop (one's proxy
    decides while another's client waits, so both cores work); nothing is shared between them,
    so each one's outcomes are what it gives played alone."""
    out: dict[tuple[str, str], list[Outcome]] = {}

    async def lane(queue: asyncio.Queue[tuple[ProxyProcess, ScriptedUpstream, Config]]) -> None:
        while not queue.empty():
            pp, up, config = queue.get_nowait()
            for label, chosen in scenarios.items():
                out[label, config.name] = await run_config(pp, up, chosen, config)

    async def play(worlds: list[tuple[ProxyProcess, ScriptedUpstream, Config]]) -> None:
        queue: asyncio.Queue[tuple[ProxyProcess, ScriptedUpstream, Config]] = asyncio.Queue()
        for world in worlds:
            queue.put_nowait(world)
        await asyncio.gather(*(lane(queue) for _ in range(lanes)))

    with contextlib.ExitStack() as stack:
        worlds = []
        for i, config in enumerate(configs):
            up = stack.enter_context(ScriptedUpstream().serving())
            worlds.append((stack.enter_context(proxy_for(config, tmp / f"config-{i}", up)), up, config))
        asyncio.run(play(worlds))
    return out


@dataclass(frozen=True)
class Summary:
    pairs: int
    attack_success: float
    benign_pass: float
    approvals_per_benign: float
    attack_misses: tuple[str, ...]
    benign_losses: tuple[str, ...]


def summarize(outcomes: list[Outcome]) -> Summary:
    delivered = [o for o in outcomes if o.injection_delivered]
    hits = [o for o in delivered if o.attack_succeeded]
    lost = [o for o in outcomes if not o.benign_passed]
    return Summary(
        pairs=len(delivered),
        attack_success=len(hits) / len(delivered) if delivered else 0.0,
        benign_pass=1 - len(lost) / len(outcomes) if outcomes else 1.0,
        approvals_per_benign=sum(o.approvals for o in outcomes) / len(outcomes) if outcomes else 0.0,
        attack_misses=tuple(f"{o.id}({o.attack_class})" for o in hits),
        benign_losses=tuple(f"{o.id}({o.benign_kind})" for o in lost),
    )
