"""CPython's cyclic garbage collector, set for a long-running process of the service.

In the throughput benchmark at 500 workers, the collector was about a tenth of each daphne's
CPU (perf: gc_collect_main and the traversals under it). With the default thresholds a young
collection runs every 700 net allocations of container objects, and every hundredth of them a
full one walks the whole heap: Django, the project, every session's state. What is loaded at
start-up stays loaded, so gc.freeze() takes it out of the collector's view; the young
generation may grow to YOUNG objects before it is collected. Cycles are still collected, less
often.
"""

import gc

YOUNG = 50_000  # container objects allocated (net) before a young collection; default 700
OLDER = 20  # young collections before a middle one, middle ones before a full one; default 10


def tune() -> None:
    """Freeze what is loaded now and space the collections out. Call once start-up is done
    (and after a fork: a frozen object is never written by the collector, so the pages a
    child shares with its parent stay shared)."""
    gc.freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)
