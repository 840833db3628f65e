"""The peers' trivial task, the same job as Herald's ``echo`` kind: return ``{"n": n}``.

Imported by the Celery workers (``celery -A bench.peer_tasks worker``), the arq workers
(``arq bench.peer_tasks.ArqSettings``) and the producers of ``bench/peers.py``. Both read
the Redis URL from ``BENCH_REDIS_URL`` (the bench's own redis-server).
"""

from __future__ import annotations

import os
from typing import Any

from arq.connections import RedisSettings
from celery import Celery

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

# Celery as its documentation starts it: Redis as the broker and as the result backend.
celery_app = Celery("bench_peer", broker=REDIS_URL, backend=REDIS_URL)
celery_app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                       broker_connection_retry_on_startup=True)
app = celery_app  # `celery -A bench.peer_tasks` looks for `app`


@celery_app.task(name="echo")
def echo(n: int) -> dict[str, int]:
    return {"n": n}


async def arq_echo(ctx: dict[str, Any], n: int) -> dict[str, int]:
    return {"n": n}


class ArqSettings:
    """arq's worker settings: its defaults but for the function and the server."""

    functions = [arq_echo]
    redis_settings = RedisSettings.from_dsn(REDIS_URL)
