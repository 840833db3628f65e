"""Medians over several runs, as the Markdown table in bench/RESULTS.md.

    python -m bench.summary bench/out/run1.json bench/out/run2.json

Per row: the median of Herald's values, the median of the baseline's, and the median of the
same-run ratios (a ratio is only ever taken within one run). Then each target, met or
missed in how many of the runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.report import _fmt
from bench.stats import median


def _rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| scenario | case | quantity | Herald | baseline | ratio (Herald / baseline) |",
             "|---|---|---|---|---|---|"]
    first = runs[0]["scenarios"]
    for index, scenario in enumerate(first):
        for row_index, row in enumerate(scenario["rows"]):
            same = [run["scenarios"][index]["rows"][row_index] for run in runs
                    if index < len(run["scenarios"]) and row_index < len(run["scenarios"][index]["rows"])]
            herald = median([r["herald"] for r in same if r["herald"] is not None])
            base_values = [r["baseline"] for r in same if r["baseline"] is not None]
            ratios = [r["ratio"] for r in same if r["ratio"] is not None]
            baseline = _fmt(median(base_values), row["unit"]) if base_values else "-"
            ratio = f"{median(ratios):.2f}" if ratios else "-"
            lines.append(f"| {scenario['scenario']} | {row['case']} | {row['metric']} | {_fmt(herald, row['unit'])} "
                         f"| {baseline} | {ratio} |")
    return lines


def _targets(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | values (per run) | met |", "|---|---|---|"]
    first = runs[0]["scenarios"]
    for index, scenario in enumerate(first):
        for t_index, target in enumerate(scenario.get("targets", [])):
            same = [run["scenarios"][index]["targets"][t_index] for run in runs]
            met = sum(1 for t in same if t["met"])
            values = "; ".join(t["value"] for t in same)
            lines.append(f"| {target['target']} | {values} | {met} of {len(same)} runs |")
    return lines


def main(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    print("\n".join(_rows(runs)))
    print()
    print("\n".join(_targets(runs)))


if __name__ == "__main__":
    main(sys.argv[1:])
