"""The demo export: a deterministic synthetic orders table as CSV or NDJSON."""

from __future__ import annotations

import asyncio
import csv
import io
import random
from datetime import datetime, timedelta, timezone
from typing import IO

import msgspec

from schemas import ExportParams
from workers.context import JobContext

COLUMNS = ("order_id", "created_at", "customer_id", "sku", "quantity", "unit_price", "total", "currency", "status")
BATCH_ROWS = 5_000
_EPOCH = datetime(2025, 1, 1, tzinfo=timezone.utc)
_STATUSES = ("paid", "shipped", "delivered", "refunded", "cancelled")
_CURRENCIES = ("EUR", "USD", "GBP")


def order_rows(start: int, count: int) -> list[tuple[object, ...]]:
    """Rows ``start .. start+count-1``; row i depends on i alone, so every export agrees."""
    rows: list[tuple[object, ...]] = []
    for i in range(start, start + count):
        rng = random.Random(i)
        quantity = rng.randint(1, 9)
        unit_price = rng.randint(199, 99_999) / 100
        created = _EPOCH + timedelta(seconds=i * 37 + rng.randint(0, 36))
        rows.append(
            (
                i + 1,
                created.strftime("%Y-%m-%dT%H:%M:%SZ"),
                rng.randint(1, 50_000),
                f"SKU-{rng.randint(1, 2_000):05d}",
                quantity,
                unit_price,
                round(quantity * unit_price, 2),
                rng.choice(_CURRENCIES),
                rng.choice(_STATUSES),
            )
        )
    return rows


def _write_batch(out: IO[bytes], fmt: str, rows: list[tuple[object, ...]]) -> None:
    if fmt == "csv":
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows)
        out.write(buffer.getvalue().encode())
    else:
        out.write(b"".join(msgspec.json.encode(dict(zip(COLUMNS, row))) + b"\n" for row in rows))


async def run_export(ctx: JobContext, params: ExportParams) -> None:
    with open(ctx.output, "wb") as out:
        if params.format == "csv":
            out.write((",".join(COLUMNS) + "\n").encode())
        for start in range(0, params.rows, BATCH_ROWS):
            await ctx.checkpoint()
            count = min(BATCH_ROWS, params.rows - start)
            rows = await asyncio.to_thread(order_rows, start, count)
            await asyncio.to_thread(_write_batch, out, params.format, rows)
            await ctx.progress((start + count) * 100 // params.rows)
