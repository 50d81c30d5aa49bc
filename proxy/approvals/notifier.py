"""Process-local approval signals: wake waiting calls, POST the webhook."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from proxy.approvals.records import (
    Approval,
)
from proxy.config import ApprovalWebhookConfig

log = logging.getLogger("envelope.approvals")

class ApprovalNotifier:
    """Process-local signals: wake waiters on a decision here; POST a webhook per new approval.

    Webhook deliveries run in tracked background tasks (`close` cancels them); each failed
    attempt is counted in `envelope_approval_webhook_failures_total`.
    """

    def __init__(self, webhook: ApprovalWebhookConfig | None = None, metrics: Any = None,
                 review_url: str | None = None):
        self.webhook = webhook
        self.metrics = metrics
        self.review_url = (review_url or "").rstrip("/")
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: Any = None
        # Shutdown began: held calls stop waiting (each is refused, pending, with its record).
        self.stopping = False

    # waking
    async def wait(self, approval_id: str, seconds: float) -> None:
        """Return after `seconds` or as soon as this process decides `approval_id`.

        The event lives only while someone waits: a decision between two waits is seen by the
        waiter's next store read (`decided` is called after the store write). Returns at once
        once shutdown began (`stop_holding`)."""
        if self.stopping:
            return
        event = self._events.setdefault(approval_id, asyncio.Event())
        self._waiters[approval_id] = self._waiters.get(approval_id, 0) + 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await event.wait()
        finally:
            left = self._waiters.pop(approval_id) - 1
            if left:
                self._waiters[approval_id] = left
            elif self._events.get(approval_id) is event:
                del self._events[approval_id]

    def stop_holding(self) -> None:
        """Shutdown began: wake every held call now and hold none from here on, so each ends
        within the grace with a reply and its audit record instead of being cut off."""
        self.stopping = True
        for event in self._events.values():
            event.set()

    def decided(self, approval_id: str) -> None:
        event = self._events.pop(approval_id, None)
        if event is not None:
            event.set()

    # webhook
    def payload(self, approval: Approval) -> dict[str, Any]:
        return {
            "type": "approval.created",
            "id": approval.id,
            "principal": approval.principal,
            "run": approval.run,
            "upstream": approval.upstream,
            "tool": approval.tool,
            "args_digest": approval.args_digest,
            "effect": approval.effect,
            "reason": approval.reason,
            "created_at": approval.created_at,
            "expires_at": approval.expires_at,
            "review_url": f"{self.review_url}/v1/approvals/{approval.id}",
        }

    def created(self, approval: Approval) -> None:
        """Schedule the webhook notification for a new approval (no-op without a webhook)."""
        if self.webhook is None:
            return
        task = asyncio.get_running_loop().create_task(self._deliver(self.payload(approval)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, payload: dict[str, Any]) -> None:
        import aiohttp

        hook = self.webhook
        assert hook is not None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = orjson.dumps(payload)
        headers = {"Content-Type": "application/json", **hook.headers}
        for attempt in range(hook.attempts):
            problem: str
            try:
                async with self._session.post(
                    hook.url, data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=hook.timeout),
                ) as resp:
                    await resp.read()
                    if 200 <= resp.status < 300:
                        return
                    problem = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if self.metrics is not None:
                self.metrics.approval_webhook_failure()
            if attempt + 1 < hook.attempts:
                delay = hook.backoff * 2**attempt
                log.warning("approval webhook for %s failed (%s); retry %d/%d in %gs", payload["id"],
                            problem, attempt + 1, hook.attempts - 1, delay)
                await asyncio.sleep(delay)
            else:
                log.error("approval webhook for %s failed %d times (%s); giving up", payload["id"],
                          hook.attempts, problem)

    async def close(self) -> None:
        """Cancel deliveries in flight and close the HTTP session."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None


