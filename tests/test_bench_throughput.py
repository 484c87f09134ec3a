"""bench/throughput.py's reading of Celery's log: the dispatch passes that saw a ready cluster."""

from bench.throughput import dispatch_passes, passes_line

LOG = """\
[2026-12-03 06:27:49,957: INFO/ForkPoolWorker-1] Task clusters.dispatch[f0] succeeded in 2.6s: \
{'claimed': 5, 'ready': 501, 'placed': 5, 'held': 496, 'reservation': None, 'seconds': 2.5105}
[2026-12-03 06:27:50,180: INFO/ForkPoolWorker-1] Task sessions.liveness[17] succeeded in 0.1s: 0
[2026-12-03 06:27:50,197: INFO/ForkPoolWorker-1] Task clusters.dispatch[c1] succeeded in 0.01s: \
{'claimed': 0, 'ready': 0, 'placed': 0, 'held': 0, 'reservation': None, 'seconds': 0.0}
[2026-12-03 06:27:51,145: INFO/ForkPoolWorker-2] Task clusters.dispatch[f6] succeeded in 2.2s: \
{'claimed': 0, 'ready': 509, 'placed': 0, 'held': 3, 'reservation': 'reserved', 'seconds': 0.5}
[2026-12-03 06:27:52,470: INFO/ForkPoolWorker-1] Task clusters.dispatch[fc] succeeded in 2.2s: \
{'claimed': 23, 'ready': 517, 'placed': 23, 'held': 486, 'reservation': None, 'seconds': 1.5}
"""


def test_the_passes_that_saw_a_ready_cluster_are_counted_and_the_empty_ones_apart():
    assert dispatch_passes(LOG) == {"count": 3, "seconds": 1.5, "empty": 1, "ready": 509}
    assert dispatch_passes("no pass ran") == {"count": 0}
    line = passes_line(
        [
            {"single_workers": 20, "cluster_workers": 80, "passes": dispatch_passes("")},
            {"single_workers": 200, "cluster_workers": 800, "passes": dispatch_passes(LOG)},
        ]
    )
    assert line == (
        "Dispatch passes that saw a ready cluster (whole run): 100 workers: none; 1,000"
        " workers: 3, median 1.50 s, 1 placing nothing, a median of 509 clusters ready."
    )
