"""The ``herald notifier`` process body."""

from __future__ import annotations

import asyncio

from herald.settings import Settings


async def run_notifier(settings: Settings, stop: asyncio.Event) -> None:
    await stop.wait()
