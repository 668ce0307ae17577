"""The light half of the benchmarks' plumbing: command line, machine description, tables, JSON output, medians
and free ports, with no import of Lightning or TorchRec, so that scripts (and the processes they spawn) that need
neither start quickly. ``benchmarks._common`` re-exports all of it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
from typing import Any, Dict, List, Optional, Sequence

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small variant that finishes in about a minute")
    p.add_argument("--json", metavar="PATH", help="write the headline figures to this JSON file")
    return p


def machine() -> Dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def table(rows: Sequence[Dict[str, Any]], columns: Optional[List[str]] = None) -> str:
    if not rows:
        return "(no rows)"
    cols = columns or list(rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path: Optional[str], figures: Dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**figures, "machine": machine()}, f, indent=2, sort_keys=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
