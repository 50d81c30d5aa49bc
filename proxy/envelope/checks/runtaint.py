"""Run taint for CEL: `run.tainted` and `run.secret` from the run's data-flow ledger.

Authorization and argument rules may read `run.tainted` (the run has read untrusted content)
and `run.secret` (it has read secret content). They run before the data-flow check, so this
check, placed just before them, reads the two flags from the run's ledger
(`proxy.envelope.checks.dataflow.run_flags`: one store read) and sets them on the call. Only a policy
whose CEL reads them pays for it (`PolicyRevision.run_taint_readers`); a policy that reads them
with `dataflow.mode: off` is refused at load (no ledger, always false).

Flags only widen: a call that already carries them (a replayed record) keeps them. Fail
closed: no store refuses `misconfigured`, a store error refuses `store_unavailable` (a rule
that forbids tainted runs must not pass because the taint could not be read).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from proxy.envelope.dataflow.ledger import run_flags
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, Verdict
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision


class RunTaintCheck:
    """Sets `run.tainted` / `run.secret` from the ledger for policies whose CEL reads them."""

    id: ClassVar[str] = "run_taint"

    def __init__(self, revision: PolicyRevision, registry: ToolRegistry,
                 services: Services | None = None):
        readers = revision.run_taint_readers()
        self._rule = readers[0][0] if readers else None
        self._store = services.store if services is not None else None

    def applies(self, call: ToolCall) -> bool:
        return self._rule is not None

    async def decide(self, call: ToolCall) -> Decision | None:
        if self._store is None:
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            f"{self._rule} reads run.tainted / run.secret but no state store keeps "
                            "the run ledgers; the call was refused", self._rule)
        try:
            tainted, secret = await run_flags(self._store, call.run.key)
        except (StoreError, TimeoutError) as exc:
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"cannot read whether run {call.run.id!r} is tainted: the state store "
                            f"cannot answer ({exc or 'timed out'}); the call was refused", self._rule)
        if (tainted and not call.run.tainted) or (secret and not call.run.secret):
            call.run = dataclasses.replace(call.run, tainted=call.run.tainted or tainted,
                                           secret=call.run.secret or secret)
        return None
