"""HTTP load helpers shared by the accept and poll scenarios: saturation (wrk, else Python) and a fixed rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import httpclient
from bench.procs import BenchError
from bench.scenario import Context
from bench.systems import API_KEY
from bench.wrk import run_wrk

REPORT_BODY = b'{"title": "bench", "pages": 1}'


def post_report(port: int, *, auth: bool) -> httpclient.Target:
    headers = [("Content-Type", "application/json")]
    if auth:
        headers.append(("Authorization", f"Bearer {API_KEY}"))
    return httpclient.Target(port=port, method="POST", paths=("/reports",), body=REPORT_BODY, headers=tuple(headers))


def get_jobs(port: int, ids: list[str], *, auth: bool) -> httpclient.Target:
    headers = (("Authorization", f"Bearer {API_KEY}"),) if auth else ()
    return httpclient.Target(port=port, method="GET", paths=tuple(f"/jobs/{i}" for i in ids), headers=headers)


def saturate(ctx: Context, target: httpclient.Target, *, script: str, auth: bool, workdir: Path,
             ids_file: Path | None = None) -> dict[str, Any]:
    """As many requests as ``connections`` keep-alive connections get answered in ``http_s``."""
    sizes = ctx.sizes
    if ctx.wrk:
        env = {"BENCH_IDS": str(ids_file)} if ids_file else {}
        if auth:
            env["BENCH_KEY"] = API_KEY
        result = run_wrk(f"http://127.0.0.1:{target.port}{target.paths[0]}", script, duration_s=sizes.http_s,
                         connections=sizes.connections, threads=2, workdir=workdir, env=env).as_dict()
    else:
        result = httpclient.run(target, processes=2, connections=sizes.connections, duration_s=sizes.http_s)
        result.pop("records", None)
    return _checked(result, target)


def _checked(result: dict[str, Any], target: httpclient.Target) -> dict[str, Any]:
    """Numbers of failed requests measure nothing: more than 1 % errors stops the scenario."""
    if result["errors"] > 0.01 * max(1, result["requests"]):
        raise BenchError(f"{result['errors']} of {result['requests']} {target.method} requests to port "
                         f"{target.port} failed ({result.get('statuses', 'see wrk')})")
    return result


def fixed_rate(ctx: Context, target: httpclient.Target, rate: float) -> dict[str, Any]:
    """An open-loop run at ``rate`` requests/s (latency counted from when each request was due)."""
    processes = 1 if rate <= 1500 else 2
    result = httpclient.run(target, processes=processes, connections=ctx.sizes.fixed_connections,
                            duration_s=ctx.sizes.http_s, rate=rate)
    result.pop("records", None)
    result["offered_rps"] = round(rate, 1)
    return _checked(result, target)
