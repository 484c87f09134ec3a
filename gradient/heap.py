"""CPython's cyclic garbage collector, set for a long-running process of the service.

By default every hundredth young collection walks the whole heap: Django, the project, every
session. What start-up loads stays loaded, so gc.freeze() hides it from the collector, and the
young generation may grow to YOUNG objects before it is collected.
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
