"""Where the benchmarks save their numbers: one JSON file each, stamped with
the date and the series it measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

from vllm_afd_dev import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def save_results(path: Path, **record: object) -> None:
    from vllm_afd_dev.patchtool.series import Series

    stamped = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "series": Series.load().hash, **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    print(f"saved {path}")
