"""``herald.tasks.TaskOwner``: the one owner of a process's background tasks and resources."""

from __future__ import annotations

import asyncio
import logging

import pytest

from herald.tasks import TaskOwner


async def test_tasks_and_resources_end_in_reverse_order_one_at_a_time() -> None:
    ended: list[str] = []

    async def runs(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # a slow end: the next one must wait for it
            ended.append(name)

    async def close(name: str) -> None:
        ended.append(name)

    async with TaskOwner() as owner:
        owner.push_async_callback(close, "store")
        owner.spawn(runs("scheduler"), "scheduler")
        owner.push_async_callback(close, "nats")
        owner.spawn(runs("consumer"), "consumer")
        await asyncio.sleep(0)
    assert ended == ["consumer", "nats", "scheduler", "store"]


async def test_a_task_spawned_with_stop_is_asked_and_awaited_not_cancelled() -> None:
    done = asyncio.Event()
    finished: list[str] = []

    async def scheduler() -> None:
        await done.wait()
        await asyncio.sleep(0)
        finished.append("leases handed back")

    async with TaskOwner() as owner:
        task = owner.spawn(scheduler(), "scheduler", stop=done.set)
    assert finished == ["leases handed back"] and not task.cancelled()


async def test_every_end_is_logged_and_a_failed_task_does_not_keep_the_others_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def returns() -> None:
        return None

    with caplog.at_level(logging.INFO, logger="herald.tasks"):
        async with TaskOwner() as owner:
            forever = owner.spawn(asyncio.Event().wait(), "forever")  # type: ignore[arg-type]
            owner.spawn(fails(), "fails")
            owner.spawn(returns(), "returns")
            await asyncio.sleep(0.01)
    assert forever.cancelled()
    ends = {(r.task, r.getMessage()) for r in caplog.records}  # type: ignore[attr-defined]
    assert ends == {("forever", "background task stopped"), ("fails", "background task failed"),
                    ("returns", "background task ended")}
    assert [r.exc_info[1] for r in caplog.records if r.exc_info][0].args == ("boom",)  # type: ignore[index]


async def test_nothing_is_spawned_after_the_owner_stopped() -> None:
    async with TaskOwner() as owner:
        pass

    async def late() -> None:
        return None

    with pytest.raises(RuntimeError, match="late"):
        owner.spawn(late(), "late")
