#!/usr/bin/env python3
"""One line per examples/probe_truth table: the truth's calls/s while each probe was watched
over while it was not (mean over the rows, and their range), the reported counts' error
against the truth (mean and the worst), and the FAIL rows. Usage: probe_truth_summary.py FILE..."""
import sys


def cells(line):
    return [x.strip() for x in line.split("|")]


for path in sys.argv[1:]:
    text = open(path).read()
    ratios, errs = [], []
    part = text.split("truth calls wholly")[1].split("The truth's calls")[0] if "truth calls wholly" in text else ""
    for line in part.splitlines():
        c = cells(line)
        if len(c) > 6 and "/" in c[5] and c[1] not in ("", "probe") and not c[1].startswith("-"):
            a, b = c[5].split("/")
            ratios.append(float(a) / float(b))
    for line in text.splitlines():
        c = cells(line)
        if len(c) > 4 and "→" in c[3] and "calls" not in c[3]:
            a, b = c[3].split("→")
            try:
                errs.append(float(b) / float(a) - 1)
            except ValueError:
                pass
    if not ratios or not errs:
        print(f"{path}: no table")
        continue
    print(
        f"{path.split('/')[-1]:22s} calls/s watched/not {sum(ratios) / len(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}]  count error mean {100 * sum(errs) / len(errs):+.1f}% "
        f"worst {100 * max(errs, key=abs):+.1f}%  FAIL rows {text.count('FAIL')}"
    )
