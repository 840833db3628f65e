"""The run's output: a table on stdout, ``results.json`` and ``results.png`` in the output dir."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any


def _fmt(value: Any, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}" if abs(value) < 10 else f"{value:,.1f}"
    else:
        text = f"{value:,}"
    return f"{text} {unit}".strip()


VARIANT_NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL", "cluster": "cluster"}


def label(result: dict[str, Any]) -> str:
    """``accept`` for the default (SQLite, one machine), else ``accept [postgres]``."""
    variant = result.get("variant", "sqlite")
    return result["scenario"] if variant == "sqlite" else f"{result['scenario']} [{variant}]"


def table(results: list[dict[str, Any]]) -> str:
    header = ("scenario", "case", "metric", "herald", "baseline", "ratio", "")
    lines: list[tuple[str, ...]] = []
    for result in results:
        base = result["baseline"]
        if result.get("error"):
            lines.append((label(result), "ERROR", result["error"][:60], "", "", "", ""))
            continue
        for row in result["rows"]:
            ratio = row["ratio"]
            mark = ""
            if ratio is not None:
                good = ratio >= 1 if row["better"] == "higher" else ratio <= 1
                mark = "(better)" if good else ""
            lines.append((label(result), row["case"], row["metric"], _fmt(row["herald"], row["unit"]),
                          _fmt(row["baseline"], row["unit"]) if base.get("available") else "n/a",
                          _fmt(ratio) + ("x" if ratio is not None else ""), mark))
        if not base.get("available"):
            lines.append((label(result), "(baseline unavailable)", "", "", "", "", base.get("reason", "")))
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header) - 1)]
    out = []
    for line in [header, *lines]:
        cells = [str(cell).ljust(widths[i]) if i < 2 else str(cell).rjust(widths[i]) if i > 2 else
                 str(cell).ljust(widths[i]) for i, cell in enumerate(line[:-1])]
        out.append("  ".join(cells) + ("  " + line[-1] if line[-1] else ""))
        if line is header:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    out.append("baselines:")
    seen = set()
    for result in results:
        if result["scenario"] not in seen:
            seen.add(result["scenario"])
            out.append(f"  {result['scenario']:9s} {result['baseline'].get('name', '-')}")
    return "\n".join(out)


def _matching_row(rows: list[dict[str, Any]], index: int, row: dict[str, Any]) -> dict[str, Any] | None:
    """The same quantity in another variant's rows: same position and metric (a case may name a
    rate that differs between variants, e.g. accept's fixed load), else same case and metric."""
    if index < len(rows) and rows[index]["metric"] == row["metric"]:
        return rows[index]
    return next((r for r in rows if r["case"] == row["case"] and r["metric"] == row["metric"]), None)


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scenarios run on more than one store or shape, row by row: each variant's value, case
    and ratio to its own baseline, and its value as a ratio to the first variant's (SQLite's
    when it ran), all from this run."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(result["scenario"], []).append(result)
    out: list[dict[str, Any]] = []
    for scenario, variants in groups.items():
        if len(variants) < 2:
            continue
        reference = next((v for v in variants if v["rows"]), variants[0])
        ref_name = reference.get("variant", "sqlite")
        for index, row in enumerate(reference["rows"]):
            entry: dict[str, Any] = {"scenario": scenario, "case": row["case"], "metric": row["metric"],
                                     "unit": row["unit"], "better": row["better"], "reference": ref_name,
                                     "values": {}, "cases": {}, "baseline_ratios": {}, "ratios": {}}
            for variant in variants:
                name = variant.get("variant", "sqlite")
                match = _matching_row(variant["rows"], index, row)
                value = match["herald"] if match else None
                entry["values"][name] = value
                entry["cases"][name] = match["case"] if match else None
                entry["baseline_ratios"][name] = match["ratio"] if match else None
                entry["ratios"][name] = (round(value / row["herald"], 3)
                                         if value is not None and row["herald"] else None)
            out.append(entry)
    return out


def comparison_table(comparison: list[dict[str, Any]]) -> str:
    names = [n for n in VARIANT_NAMES if any(n in e["values"] for e in comparison)]
    reference = comparison[0]["reference"] if comparison else "sqlite"
    others = [n for n in names if n != reference]
    header = ("scenario", "case", "metric", *(VARIANT_NAMES[n] for n in names),
              *(f"{n}/{reference}" for n in others))
    lines: list[tuple[str, ...]] = []
    for e in comparison:
        cells = []
        for n in names:
            if n not in e["values"]:
                cells.append("")
                continue
            text = _fmt(e["values"][n], e["unit"])
            if e["baseline_ratios"].get(n) is not None:
                text += f" [{e['baseline_ratios'][n]:.2f}x]"
            if e["cases"].get(n) not in (None, e["case"]):
                text += f" ({e['cases'][n]})"
            cells.append(text)
        ratios = [f"{e['ratios'][n]:.2f}x" if e["ratios"].get(n) is not None else ("" if n not in e["values"] else "-")
                  for n in others]
        lines.append((e["scenario"], e["case"], e["metric"], *cells, *ratios))
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
    out = []
    for line in [header, *lines]:
        out.append("  ".join(str(c).ljust(widths[i]) if i < 3 else str(c).rjust(widths[i]) for i, c in enumerate(line)))
        if line is header:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def targets(results: list[dict[str, Any]]) -> str:
    out = []
    for result in results:
        for target in result.get("targets", []):
            met = {True: "met   ", False: "MISSED", None: "n/a   "}[target["met"]]
            where = "" if result.get("variant", "sqlite") == "sqlite" else f" [{result['variant']}]"
            out.append(f"  {met}  {target['target']}{where}: {target['value']}")
    return "\n".join(out)


def notes(results: list[dict[str, Any]]) -> str:
    return "\n".join(f"  {label(result)}: {note}" for result in results for note in result.get("notes", []))


def environment() -> dict[str, Any]:
    import os

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "platform": platform.platform()}


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def chart(path: Path, results: list[dict[str, Any]]) -> str | None:
    """A PNG with one panel per scenario (Herald vs baseline per row); returns why not, if it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    panels = [r for r in results if r.get("rows") and not r.get("error")]
    if not panels:
        return "nothing to chart"
    charted = [[row for row in r["rows"] if row["herald"] is not None and row["metric"] != "max"] for r in panels]
    heights = [max(2, len(rows)) for rows in charted]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 0.42 * sum(heights) + 1.2 * len(panels)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, result, data in zip(axes.flat, panels, charted):
        labels = [f"{r['case']}: {r['metric']}" for r in data]
        # Each row on its own scale: bars are relative to the larger of the pair, the real
        # values are written beside them.
        herald = [1.0 if not r["baseline"] else r["herald"] / max(r["herald"], r["baseline"]) for r in data]
        base = [0.0 if not r["baseline"] else r["baseline"] / max(r["herald"], r["baseline"]) for r in data]
        y = range(len(data))
        ax.barh([i - 0.2 for i in y], herald, height=0.4, color="#2b6cb0", label="Herald")
        ax.barh([i + 0.2 for i in y], base, height=0.4, color="#a0aec0", label="baseline")
        for i, r, h, b in zip(y, data, herald, base):
            ax.text(h + 0.01, i - 0.2, _fmt(r["herald"], r["unit"]), va="center", fontsize=7)
            if r["baseline"]:
                ratio = f"  (ratio {r['ratio']:.2f})" if r["ratio"] is not None else ""
                ax.text(b + 0.01, i + 0.2, _fmt(r["baseline"], r["unit"]) + ratio, va="center", fontsize=7,
                        color="#4a5568")
        ax.set_yticks(list(y))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.45)
        ax.set_xticks([])
        ax.set_title(f"{label(result)}: {result['title']}\nbaseline: {result['baseline'].get('name', '-')}",
                     fontsize=8, loc="left")
        ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, frameon=False)
    fig.suptitle("Herald vs baselines, same run (each pair of bars on its own scale)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
