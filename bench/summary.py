"""Medians over several runs, as the Markdown table in bench/RESULTS.md.

    python -m bench.summary bench/out/run1.json bench/out/run2.json

Per row: the median of Herald's values, the median of the baseline's, and the median of the
same-run ratios (a ratio is only ever taken within one run). Then each target, met or
missed in how many of the runs. Runs with ``--store both`` or ``--shape cluster`` also get
the side-by-side table: per store or shape the median value (and the median of its ratios
to its baseline), and the median of the same-run ratios to SQLite's value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.report import VARIANT_NAMES, _fmt, label
from bench.stats import median


def _case(rows: list[dict[str, Any]]) -> str:
    """A row's case, or each run's when they differ (accept's fixed load is a measured rate)."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    return cases[0] if len(cases) == 1 else "; ".join(cases)


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
            lines.append(f"| {label(scenario)} | {_case(same)} | {row['metric']} | {_fmt(herald, row['unit'])} "
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
            where = "" if scenario.get("variant", "sqlite") == "sqlite" else f" [{scenario['variant']}]"
            lines.append(f"| {target['target']}{where} | {values} | {met} of {len(same)} runs |")
    return lines


def _comparison(runs: list[dict[str, Any]]) -> list[str]:
    first = runs[0].get("comparison") or []
    if not first:
        return []
    names = [n for n in VARIANT_NAMES if any(n in e["values"] for e in first)]
    reference = first[0]["reference"]
    others = [n for n in names if n != reference]
    lines = ["| scenario | case | quantity | " + " | ".join(VARIANT_NAMES[n] for n in names) + " | "
             + " | ".join(f"{VARIANT_NAMES[n]} / {VARIANT_NAMES[reference]}" for n in others) + " |",
             "|---" * (3 + len(names) + len(others)) + "|"]
    for index, entry in enumerate(first):
        same = [run["comparison"][index] for run in runs if index < len(run.get("comparison") or [])]
        cells = []
        for n in names:
            values = [e["values"][n] for e in same if e["values"].get(n) is not None]
            base = [e["baseline_ratios"][n] for e in same if e["baseline_ratios"].get(n) is not None]
            text = _fmt(median(values), entry["unit"]) if values else "-"
            if base:
                text += f" ({median(base):.2f})"
            cells.append(text)
        ratios = []
        for n in others:
            values = [e["ratios"][n] for e in same if e["ratios"].get(n) is not None]
            ratios.append(f"{median(values):.2f}" if values else "-")
        lines.append(f"| {entry['scenario']} | {_case(same)} | {entry['metric']} | " + " | ".join(cells) + " | "
                     + " | ".join(ratios) + " |")
    return lines


def main(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    print("\n".join(_rows(runs)))
    print()
    print("\n".join(_targets(runs)))
    comparison = _comparison(runs)
    if comparison:
        print()
        print("\n".join(comparison))


if __name__ == "__main__":
    main(sys.argv[1:])
