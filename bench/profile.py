"""Profiles of Herald processes under a scenario's load, with py-spy.

``python -m bench --only accept --profile gateway`` attaches ``py-spy record`` (raw
collapsed stacks, 250 samples/s, with idle frames left out) to every Herald process
whose role matches (``gateway``, ``worker``, ``notifier``) for its whole life, and
prints a summary of each at the end; the raw files stay in ``<out>/profiles/``, ready
for ``flamegraph.pl`` or speedscope.

    python -m bench.profile bench/out/profiles/accept-herald-gateway.txt   # summarize again
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

RATE = 250


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record_argv(pid: int, output: Path) -> list[str]:
    binary = py_spy()
    if binary is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    return [binary, "record", "--pid", str(pid), "--format", "raw", "--rate", str(RATE), "--output", str(output),
            "--nonblocking"]


def _frame(raw: str) -> str:
    """``function (path/to/module.py:123)`` -> ``function (module.py)``: lines merged."""
    name, _, where = raw.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{name} ({short})"


def summarize(path: Path, top: int = 25) -> str:
    """Top frames by self time and by inclusive time, as % of the samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):  # the first frame is the process/thread
            inclusive[frame] += n
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.name}: {total} samples ({total / RATE:.1f} s of CPU)", "  self:"]
    lines += [f"    {100 * n / total:5.1f} %  {f}" for f, n in own.most_common(top)]
    lines.append("  inclusive:")
    lines += [f"    {100 * n / total:5.1f} %  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(summarize(Path(name)))
