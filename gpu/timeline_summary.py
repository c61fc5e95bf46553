"""Summarises an Nsight Systems GPU trace of kandle's bench run: GPU-busy time against the gaps
between operations (host time the GPU waits for), by gap size, and the kernels by total time.

    nsys stats --report cuda_gpu_trace --format csv --output PREFIX REPORT.nsys-rep
    python3 gpu/timeline_summary.py PREFIX_cuda_gpu_trace.csv OUT.md

Every kernel, copy and memset on the GPU counts as busy; overlapping operations (several
streams) count once. The window runs from the first operation's start to the last one's end.
"""

import csv
import sys
from collections import defaultdict

GAP_BINS_US = [(0, 10), (10, 100), (100, 1000), (1000, float("inf"))]


def column(header, prefix):
    for i, name in enumerate(header):
        if name.strip().lower().startswith(prefix):
            return i
    raise SystemExit(f"no column starting with {prefix!r} in {header}")


def main(trace, out):
    with open(trace, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise SystemExit(f"{trace}: no GPU operation recorded")
    header, rows = rows[0], rows[1:]
    start_at, duration_at, name_at = (
        column(header, "start"),
        column(header, "duration"),
        column(header, "name"),
    )
    ops = sorted(
        (int(float(r[start_at])), int(float(r[duration_at])), r[name_at]) for r in rows if r
    )
    first, last = ops[0][0], max(s + d for s, d, _ in ops)
    busy, gaps, end = 0, [], first
    for start, duration, _ in ops:
        if start > end:
            gaps.append(start - end)
        busy += max(0, start + duration - max(start, end))
        end = max(end, start + duration)
    window = last - first
    by_name = defaultdict(lambda: [0, 0])
    for _, duration, name in ops:
        by_name[name][0] += 1
        by_name[name][1] += duration
    lines = [
        "# Where the GPU's time goes (Nsight Systems trace of the bench run)",
        "",
        f"- operations (kernels, copies, memsets): {len(ops)}",
        f"- window: {window / 1e6:.2f} ms; GPU busy {busy / 1e6:.2f} ms "
        f"({100 * busy / max(window, 1):.1f}%), idle between operations "
        f"{(window - busy) / 1e6:.2f} ms",
        "",
        "| gap between operations | count | total ms | share of the window |",
        "|---|---|---|---|",
    ]
    for lo, hi in GAP_BINS_US:
        inside = [g for g in gaps if lo * 1e3 <= g < hi * 1e3]
        label = f"{lo}-{hi} us" if hi != float("inf") else f">= {lo} us"
        total = sum(inside)
        lines.append(
            f"| {label} | {len(inside)} | {total / 1e6:.2f} | {100 * total / max(window, 1):.1f}% |"
        )
    lines += [
        "",
        "| operation | count | total ms | mean us | share of busy |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    for name, (count, total) in ranked[:25]:
        lines.append(
            f"| {name[:90]} | {count} | {total / 1e6:.2f} | {total / count / 1e3:.1f} "
            f"| {100 * total / max(busy, 1):.1f}% |"
        )
    text = "\n".join(lines) + "\n"
    open(out, "w").write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
