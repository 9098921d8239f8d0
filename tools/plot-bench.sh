#!/usr/bin/env bash
# Draws kvtier-bench --json results as one PNG bar chart: for every
# comparison of every file, the baseline (drawn as 1) and kvtier relative to
# it (the comparison's ratio, oriented so that higher is better for kvtier:
# bandwidths, hit rates, and inverted latencies and bytes alike), labelled
# with the ratio; the raw figures go under the comparison's name, and the
# target ratio is a red line over the kvtier bar where the file has one.
#
#   tools/plot-bench.sh OUT.png RESULT.json [RESULT.json ...]
#
# Bars are named "<file name without .json>: <comparison>". Comparisons
# without a baseline (ratio 0) are listed on stderr and left out. Needs
# python3 and gnuplot (Debian: gnuplot-nox, see tools/setup-deps.sh).
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 OUT.png RESULT.json [RESULT.json ...]" >&2
  exit 2
fi
out=$1
shift
for tool in python3 gnuplot; do
  command -v "$tool" >/dev/null 2>&1 || { echo "plot-bench: $tool is missing (tools/setup-deps.sh)" >&2; exit 1; }
done

data=$(mktemp /tmp/plot-bench-XXXXXX.tsv)
tics=$(mktemp /tmp/plot-bench-XXXXXX.gp)
trap 'rm -f "$data" "$tics"' EXIT

# The data: one tab-separated row per comparison (baseline = 1, kvtier
# ratio, target ratio or "?", the ratio as text); the x labels (name, wrapped,
# and raw figures) and the title as gnuplot commands.
python3 - "$data" "$tics" "$@" <<'PY'
import json, os, sys, textwrap

data_path, tics_path, files = sys.argv[1], sys.argv[2], sys.argv[3:]
rows, cpu = [], None
for path in files:
    with open(path) as f:
        doc = json.load(f)
    cpu = cpu or doc.get("machine", {}).get("cpu")
    tag = os.path.basename(path)
    tag = tag[:-5] if tag.endswith(".json") else tag
    for c in doc.get("comparisons", []):
        name = f"{tag}: {c['name']}"
        ratio = float(c.get("ratio", 0))
        if ratio <= 0:
            print(f"plot-bench: {name}: no baseline to compare with, left out", file=sys.stderr)
            continue
        fmt = lambda v: f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        raw = f"{fmt(c['kvtier'])} vs {fmt(c['baseline'])} {c.get('unit', '')}".strip()
        target = c.get("target")
        rows.append((textwrap.wrap(name, 22) + [raw], ratio, f"{float(target):.4f}" if target else "?"))
if not rows:
    sys.exit("plot-bench: no comparisons with a baseline in " + " ".join(files))
quote = lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
with open(data_path, "w") as f:
    for _, ratio, target in rows:
        f.write(f"1\t{ratio:.4f}\t{target}\t{ratio:.2f}x\n")
with open(tics_path, "w") as f:
    title = "kvtier-bench: kvtier relative to its baseline" + (f" ({cpu})" if cpu else "")
    f.write(f"set title {quote(title)}\n")
    # Tic labels are format strings to gnuplot: a literal % is %%.
    tics = ", ".join(f"{quote(chr(10).join(lines).replace('%', '%%'))} {i}" for i, (lines, _, _) in enumerate(rows))
    f.write(f"set xtics ({tics})\n")
PY

rows=$(wc -l <"$data")
width=$((rows * 150 + 200))
[ "$width" -lt 800 ] && width=800
terminal=png
gnuplot -e 'set terminal' 2>/dev/null | grep -qw pngcairo && terminal=pngcairo

# In a clustered histogram of two series (gap 1), row i's bars are centred
# at i -/+ 1/6.
gnuplot <<GP
set terminal $terminal size $width,560 noenhanced
set output "$out"
set datafile separator "\t"
set datafile missing "?"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set ylabel "relative to the baseline (higher is better for kvtier)"
set yrange [0:*]
set offsets 0, 0, graph 0.12, 0
set grid ytics
set key above horizontal
set xtics nomirror font ",8"
set bmargin 7
load "$tics"
plot "$data" using 1 title "baseline (= 1)" lc rgb "#9e9e9e", \
     "" using 2 title "kvtier" lc rgb "#1f77b4", \
     "" using (\$0 + 1.0/6):2:4 with labels offset 0,0.7 font ",8" notitle, \
     "" using (\$0 + 1.0/6 - 0.16):3:(0.32):(0) with vectors nohead lw 3 lc rgb "#d62728" title "target"
GP
echo "plot-bench: wrote $out ($rows comparisons)"
