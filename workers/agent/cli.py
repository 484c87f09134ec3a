"""gradient-worker's command line (placeholder until the agent lands)."""

import sys


def main() -> int:
    print("gradient-worker: not built yet", file=sys.stderr)
    return 2
