"""bench/placement.py's target: the deepest queue's median over its runs."""

from bench.placement import Pass, Run, figures


def _run(depth: int, chosen: int, run: int) -> Run:
    # Two passes, so the run's ratio is its bytes summed, not a pass's.
    passes = [Pass(chosen=chosen, reference=500), Pass(chosen=chosen, reference=500)]
    return Run(depth=depth, workers=200, passes=passes, run=run)


def test_the_target_takes_the_deepest_queues_median_run():
    runs = [
        _run(200, 600, 1),  # 1.2 at a shallow queue: not the target's depth
        _run(2000, 560, 1),
        _run(200, 600, 2),
        _run(2000, 540, 2),
        _run(200, 600, 3),
        _run(2000, 580, 3),
    ]
    (figure,) = figures(runs)
    assert figure.figure.endswith("2,000 clusters queued")
    assert figure.result == "1.120 (median of 3: 1.080 to 1.160)"
    assert not figure.met
    (alone,) = figures([_run(2000, 540, 0)])
    assert alone.result == "1.080"
    assert alone.met
