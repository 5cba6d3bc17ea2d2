"""Summarise py-spy raw (collapsed) output: samples per process, and the functions with
the most inclusive and self samples in each.

    py-spy record --subprocesses -f raw -o prof.txt -- python stages.py ingest
    python profsum.py prof.txt [--top 15] [--match agent]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--match", default="", help="only processes whose label contains this")
    a = p.parse_args()
    procs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    selfs: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in Path(a.file).read_text().splitlines():
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        # Nested processes (--subprocesses) appear as a "process ..." frame under their parent.
        starts = [i for i, f in enumerate(frames) if f.startswith("process ")]
        first = starts[-1] if starts else -1
        label = frames[first] if starts else "?"
        label = re.sub(r"process \d+:", "", label)
        label = re.sub(r"--coordinator \S+ ", "", label)
        label = re.sub(r"--environment-id (\S+) .*", r"\1", label)
        label = re.sub(r"/tmp/\S+/", "", label)
        frames = frames[first:]
        label = re.sub(r"/opt/tkvenv/bin/python\S*", "py", label)[:110]
        if a.match and a.match not in label:
            continue
        n = int(count)
        totals[label] += n
        seen = set()
        for f in frames[1:]:
            key = re.sub(r"\s*\(/[^)]*/(site-packages|lib/python3\.\d+|main)/", " (", f)
            if key not in seen:
                procs[label][key] += n
                seen.add(key)
        leaf = re.sub(r"\s*\(/[^)]*/(site-packages|lib/python3\.\d+|main)/", " (", frames[-1])
        selfs[label][leaf] += n
    for label, total in totals.most_common():
        print(f"\n== {label}: {total} samples")
        print("  inclusive:")
        for f, n in procs[label].most_common(a.top):
            print(f"    {n / total * 100:5.1f}%  {f}")
        print("  self:")
        for f, n in selfs[label].most_common(a.top):
            print(f"    {n / total * 100:5.1f}%  {f}")


if __name__ == "__main__":
    main()
