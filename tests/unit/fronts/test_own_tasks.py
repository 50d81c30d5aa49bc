"""`_Scope._own_tasks`: a `tasks/list` answer keeps only the principal's own tasks (the e2e
tests in tests/e2e/test_cross_worker_attacks_e2e.py show it on the wire; these pin the odd shapes
and the bound)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from proxy.envelope.types import Principal
from proxy.errors import StoreError
from proxy.fronts.per_upstream import LISTED_TASKS, _Scope


class Front:
    """What `_own_tasks` reads of its front: whose tasks are known (`_task_tool`)."""

    def __init__(self, owned: set[str], fail: bool = False) -> None:
        self.owned, self.fail, self.asked = owned, fail, 0

    async def _task_tool(self, target: Any, principal: Principal, task_id: Any) -> str | None:
        self.asked += 1
        if self.fail:
            raise StoreError("redis: connection refused")
        return "read_page" if task_id in self.owned else None


async def own(front: Front, result: Any) -> tuple[dict[str, Any], bool]:
    scope: Any = SimpleNamespace(front=front, target=SimpleNamespace(name="h"), principal=Principal(id="alice"))
    return await _Scope._own_tasks(scope, result)


async def test_only_the_principals_tasks_are_kept_with_the_rest_of_the_result() -> None:
    result = {"tasks": [{"taskId": "a"}, {"taskId": "m"}, "junk", {"id": "a"}], "nextCursor": "c2"}
    assert await own(Front({"a"}), result) == ({"tasks": [{"taskId": "a"}], "nextCursor": "c2"}, True)


async def test_an_answer_of_own_tasks_only_is_unchanged() -> None:
    result = {"tasks": [{"taskId": "a"}]}
    assert await own(Front({"a"}), result) == ({"tasks": [{"taskId": "a"}]}, False)


@pytest.mark.parametrize("result", [None, [{"taskId": "a"}], "tasks", {"tasks": {"taskId": "a"}}, {"other": 1}])
async def test_a_result_without_a_list_of_tasks_keeps_none(result: Any) -> None:
    kept, changed = await own(Front({"a"}), result)
    assert kept["tasks"] == [] and changed


async def test_past_the_bound_nothing_is_looked_up_or_kept() -> None:
    front = Front({f"t{i}" for i in range(LISTED_TASKS + 10)})
    kept, changed = await own(front, {"tasks": [{"taskId": f"t{i}"} for i in range(LISTED_TASKS + 10)]})
    assert len(kept["tasks"]) == LISTED_TASKS and front.asked == LISTED_TASKS and changed


async def test_a_store_that_cannot_answer_is_raised_not_read_as_none_owned() -> None:
    with pytest.raises(StoreError):
        await own(Front({"a"}, fail=True), {"tasks": [{"taskId": "a"}]})
