"""The command line every benchmark script shares: --quick, --device, --out; JSON out, a table printed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Callable

from infra_lib.device import pick_device

RESULTS = Path(__file__).resolve().parent / "results"


def load_average() -> float | None:
    """The 1-minute system load average, where the OS reports one (a busy machine skews timings)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def benchmark_main(
    argv: list[str] | None, description: str, name: str, run: Callable[..., dict], format_table: Callable[[dict], str]
) -> int:
    """Parse the shared options, run ``run(device, quick)``, write its JSON, print its table."""
    default_out = RESULTS / f"{name}.json"
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (CI)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 or mps (default: auto)")
    parser.add_argument("--out", type=Path, default=default_out, help=f"JSON output (default: {default_out})")
    args = parser.parse_args(argv)
    result = run(pick_device(args.device), args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_table(result))
    print(f"wrote {args.out}")
    return 0
