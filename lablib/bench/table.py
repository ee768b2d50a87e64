"""The run's result as one Markdown table, machine first, and writing it into docs/performance.md."""
from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path

from ..paths import ROOT


def machine(backend="auto") -> dict:
    import torch

    from ..pool import resolve_backend

    return {"cores": os.cpu_count(), "backend": resolve_backend(backend, 2), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(terse=True),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "date": time.strftime("%Y-%m-%d")}


def _cell(values) -> str:
    if not values:
        return ""
    med = statistics.median(values)
    spread = f" ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else ""
    return f"{med:.3g}{spread}"


def table(result: dict) -> str:
    """The result as a Markdown table, machine first."""
    m = result["machine"]
    head = (f"{m['date']}: {m['cores']} cores, {m['gpus']} GPU(s), backend {m['backend']}, torch {m['torch']}, "
            f"Python {m['python']}; {'--quick, ' if result['quick'] else ''}median (min-max) of {result['reps']} "
            "repetitions unless noted")
    lines = [head, "", "| item | measure | unit | course | anchor | ratio | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if not r.ours:
            lines.append(f"| {r.item} | {r.measure} | | {r.note} | | | | |")
            continue
        course = _cell(r.ours) + (f"; {r.note}" if r.note else "")
        anchor = f"{_cell(r.anchor)} {r.anchor_name}".strip() if r.anchor else ""
        ratio = f"{r.ratio:.3g}" if r.ratio is not None else ""
        met = {True: "yes", False: "NO", None: ""}[r.met]
        lines.append(f"| {r.item} | {r.measure} | {r.unit} | {course} | {anchor} | {ratio} | {r.target} | {met} |")
    return "\n".join(lines)


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def write_readme(text: str, readme: Path = ROOT / "docs" / "performance.md") -> None:
    body = readme.read_text()
    if README_START not in body or README_END not in body:
        raise SystemExit(f"{readme}: no {README_START} ... {README_END} section to write the table into")
    new = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END),
                 lambda _: f"{README_START}\n{text}\n{README_END}", body, flags=re.S)
    readme.write_text(new)
