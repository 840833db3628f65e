"""The benchmark still works: ``python -m bench --smoke`` runs every scenario at minimal size.

Only the shape of the output is checked (every scenario, with Herald's numbers, its
baseline — or why the baseline is unavailable, e.g. without wrk or nginx — and the
ratios); the numbers themselves are for bench/RESULTS.md, not for pass/fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peers

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("accept", "poll", "sse", "longpoll", "webhooks", "e2e", "output", "noisy")
# Without wrk and nchan only these run differently (a Python load client; no nchan baseline):
# the others would only repeat the first run.
TOOL_SCENARIOS = ("accept", "poll", "sse", "longpoll", "output")


@pytest.mark.timeout(320)
@pytest.mark.parametrize("without", ["", "wrk,nchan"], ids=["tools-as-installed", "without-wrk-and-nchan"])
def test_smoke_run_reports_every_scenario_against_its_baseline(tmp_path: Path, without: str) -> None:
    scenarios = SCENARIOS if not without else TOOL_SCENARIOS
    # The peers (Celery + Redis, arq) beside e2e, where Debian's redis-server is installed.
    with_peers = not without and peers.missing() is None
    run = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path), "--without", without,
                          "--only", ",".join(scenarios), *(["--peers", "--rounds", "2"] if with_peers else [])],
                         cwd=ROOT, capture_output=True, text=True, timeout=310)
    assert run.returncode == 0, f"bench --smoke failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["mode"] == "smoke"
    by_name = {s["scenario"]: s for s in document["scenarios"]}
    assert set(scenarios) <= set(by_name), f"missing scenarios: {set(scenarios) - set(by_name)}"
    for name in scenarios:
        scenario = by_name[name]
        assert scenario["error"] is None, f"{name}: {scenario['error']}"
        assert {"herald", "baseline", "ratio"} <= set(scenario), name
        assert scenario["herald"], f"{name}: no Herald numbers"
        assert scenario["rows"] and all(r["herald"] is not None for r in scenario["rows"]), name
        baseline = scenario["baseline"]
        if baseline["available"]:
            assert any(r["ratio"] is not None for r in scenario["rows"]), f"{name}: no ratio"
        else:
            assert baseline["reason"], f"{name}: baseline unavailable without a reason"
            assert all(r["ratio"] is None for r in scenario["rows"]), name
    assert "accept" in run.stdout and "baselines:" in run.stdout, "the table is printed"
    # The output scenario read the chunks it measures (how many arrived is a number, not pass/fail).
    assert by_name["output"]["herald"]["delivered"] > 0, by_name["output"]["herald"]
    if with_peers:  # two pairs, each peer's run after one of Herald's bursts
        found = by_name["e2e"]["herald"]["peers"]
        assert len(found["herald"]) == 2 and all(b["completed"] == b["jobs"] > 0 for b in found["herald"]), found
        for peer in peers.PEERS:
            assert len(found[peer]) == 2 and all(r["completed"] == r["jobs"] > 0 for r in found[peer]), found
        ratios = [r["ratio"] for r in by_name["e2e"]["rows"] if r["metric"].startswith("jobs/s vs ")]
        assert len(ratios) == len(peers.PEERS) and None not in ratios, by_name["e2e"]["rows"]
        medians = [r["herald"] for r in by_name["e2e"]["rows"] if "median of 2 pair" in r["metric"]]
        assert len(medians) == len(peers.PEERS) and all(m > 0 for m in medians), by_name["e2e"]["rows"]
    if "nchan" in without:
        assert not by_name["sse"]["baseline"]["available"] and not by_name["longpoll"]["baseline"]["available"]
        assert not by_name["output"]["baseline"]["available"]
        assert "apt-get install" in run.stdout, "says how to get the missing tools"
