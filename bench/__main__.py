"""Runs the benchmarks one after another (default: all, in BENCHES' order), each as its own
process writing its section of docs/benchmarks.md; a failing one is reported and the rest still
run. The figures move with the load average, which each section records.

A new benchmark is a script here and a NAME in BENCHES: it takes `_common.parser()`'s
arguments, calls `_common.start(args)` and ends with `_common.finish(...)`, which writes its
figures block and summary rows. Its method is written in the doc, below its figures, by hand.
"""

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ".venv/bin/python"

# name -> the script and its arguments (before --write).
BENCHES = {
    "claim": ["bench/claim.py"],
    "dispatch-pass": ["bench/dispatch.py", "--only", "pass"],
    "gang-start": ["bench/dispatch.py", "--only", "gang"],
    "gang-start-agents": ["bench/gang_start.py"],  # parts idle, start, sustained
    "throughput": ["bench/throughput.py"],
    "queue-depth": ["bench/queue_depth.py"],
    "placement": ["bench/placement.py"],
    "storm": ["bench/storm.py"],
    "retention": ["bench/retention.py"],
    "history": ["bench/history.py"],
    "health": ["bench/health.py"],
    "session": ["bench/session.py"],
    "agent": ["bench/gang_start.py", "--only", "agent"],
}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/run", description=__doc__.splitlines()[0], epilog=", ".join(BENCHES)
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run")
    parser.add_argument("--doc", default="docs/benchmarks.md", help="the markdown file to update")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    names = args.names or list(BENCHES)
    failed = []
    for name in names:
        command = [PYTHON, *BENCHES[name], "--write", args.doc]
        print(f"== {name}: {shlex.join(command)}", flush=True)
        if args.dry_run:
            continue
        began = time.monotonic()
        code = subprocess.run(command, cwd=ROOT).returncode
        took = time.monotonic() - began
        print(f"== {name}: exit {code} after {took:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
