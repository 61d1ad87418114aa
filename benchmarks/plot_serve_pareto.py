#!/usr/bin/env python3
"""The Pareto view of a serving sweep: output tokens per second per GPU
against tokens per second per user, one line per deployment, from the result
files that `vllm bench serve --save-result` wrote (benchmarks/afd_serve_sweep.py).

    python3 benchmarks/plot_serve_pareto.py RESULT_DIR --png docs/img/serve_pareto.png

Needs matplotlib. Also writes RESULT_DIR/summary.json with the plotted points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(result_dir: Path) -> dict[str, list[dict]]:
    """Per deployment, its points sorted by concurrency."""
    found: dict[str, list[dict]] = {}
    for path in sorted(result_dir.glob("*-c*.json")):
        r = json.loads(path.read_text())
        if "deployment" not in r:  # written without the sweep's --metadata
            continue
        found.setdefault(r["deployment"], []).append({
            "concurrency": r["max_concurrency"],
            "output_tok_s_per_gpu": r["output_throughput"] / int(r["gpus"]),
            "tok_s_per_user": 1000 / r["median_tpot_ms"],
            "median_tpot_ms": r["median_tpot_ms"],
            "completed": r["completed"],
        })  # fmt: skip
    for series in found.values():
        series.sort(key=lambda p: p["concurrency"])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result_dir", type=Path)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--title", default="Qwen3-30B-A3B shape (8 layers), 2 x H200")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plotting needs matplotlib ({e}); pip install matplotlib") from e
    series = points(args.result_dir)
    if not series:
        raise SystemExit(f"no `vllm bench serve` results with a deployment in {args.result_dir}")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        x = [p["tok_s_per_user"] for p in pts]
        y = [p["output_tok_s_per_gpu"] for p in pts]
        ax.plot(x, y, marker="o", label=name)
        for p, xi, yi in zip(pts, x, y, strict=True):
            ax.annotate(str(p["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("tokens/s per user (1000 / median TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    (args.result_dir / "summary.json").write_text(json.dumps(series, indent=2) + "\n")
    print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
