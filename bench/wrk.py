"""Saturation load with ``wrk`` (Debian's), driven by small Lua scripts.

Each script ends with the same ``done()`` hook, which prints one ``BENCH_JSON`` line
(requests, errors, latency percentiles in microseconds); the run's CPU time comes from
``wait4``'s resource usage, so the report can show that wrk was not the bottleneck.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.procs import BenchError

DONE_HOOK = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, ' ..
    '"write_errors": %d, "status_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, ' ..
    '"p99_us": %d, "max_us": %d, "mean_us": %.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""

POST_REPORT = r"""
wrk.method = "POST"
wrk.body = '{"title": "bench", "pages": 1}'
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_KEY")
if key then wrk.headers["Authorization"] = "Bearer " .. key end
"""

GET_RANDOM_JOB = r"""
local key = os.getenv("BENCH_KEY")
if key then wrk.headers["Authorization"] = "Bearer " .. key end
local ids = {}
init = function(args)
  for line in io.lines(os.getenv("BENCH_IDS")) do ids[#ids + 1] = line end
  math.randomseed(os.time() + math.floor(os.clock() * 1000000))
end
request = function()
  return wrk.format("GET", "/jobs/" .. ids[math.random(#ids)])
end
"""

SCRIPTS = {"post-report": POST_REPORT, "get-random-job": GET_RANDOM_JOB}


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    rps: float
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    cpu_pct: float  # wrk's own CPU, % of one core

    def as_dict(self) -> dict[str, float]:
        return {"rps": round(self.rps, 1), "requests": self.requests, "errors": self.errors,
                "p50_ms": self.p50_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms, "max_ms": self.max_ms,
                "loadgen": "wrk", "loadgen_cpu_pct": self.cpu_pct}


def wrk_path() -> str | None:
    return shutil.which("wrk")


def run_wrk(url: str, script: str, *, duration_s: float, connections: int, threads: int, workdir: Path,
            env: Mapping[str, str] | None = None) -> WrkResult:
    binary = wrk_path()
    if binary is None:
        raise BenchError("wrk is not installed")
    script_path = workdir / f"{script}.lua"
    if not script_path.exists():
        script_path.write_text(SCRIPTS[script] + DONE_HOOK)
    argv = [binary, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration_s))}s",
            "--timeout", "10s", "-s", str(script_path), url]
    started = time.monotonic()
    with open(workdir / "wrk.out", "w+b") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _pid, status, usage = os.wait4(popen.pid, 0)
        popen.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        out.seek(0)
        text = out.read().decode(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if popen.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({popen.returncode}): {text[-1500:]}")
    data = json.loads(line.removeprefix("BENCH_JSON "))
    duration = data["duration_us"] / 1e6
    errors = sum(data[k] for k in ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts"))
    return WrkResult(
        requests=data["requests"],
        duration_s=duration,
        rps=data["requests"] / duration if duration else 0.0,
        errors=errors,
        p50_ms=data["p50_us"] / 1000,
        p90_ms=data["p90_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        max_ms=data["max_us"] / 1000,
        cpu_pct=round(100 * (usage.ru_utime + usage.ru_stime) / wall, 1),
    )
