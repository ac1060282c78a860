"""Medians of the host steps of each stage's decode windows, from a launch's traces
(strata/trace.py): came -> checked -> launching -> queued -> sent. Usage: host_marks.py DIR"""
import sys
from pathlib import Path
from statistics import median

from strata.bench import tracereport

traces = tracereport.load(Path(sys.argv[1]))
ids = tracereport.windows_through(traces)[10:]
steps = ["came", "checked", "launching", "queued", "sent"]
for name in sorted(n for n in traces if n.startswith("stage")):
    marks = traces[name]["marks"]
    parts = []
    for a, b in zip(steps, steps[1:]):
        d = [(marks[w][b] - marks[w][a]) * 1e3 for w in ids if a in marks[w] and b in marks[w]]
        if d:
            parts.append(f"{a}->{b} {median(d):.3f}")
    print(f"{name}: " + ", ".join(parts) + " ms (medians)")
