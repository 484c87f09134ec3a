"""bench/session.py's target: no operation's CPU per call grows from the smallest size to the
largest by more than its bound."""

from bench.session import figures


def _row(operation: str, workers: int, queued: int, process: float, postgres: float) -> dict:
    return {
        "operation": operation,
        "workers": workers,
        "queued": queued,
        "process": process,
        "postgres": postgres,
        "redis": 0.0,
    }


def test_the_figure_is_the_most_grown_operation_from_the_smallest_size_to_the_largest():
    rows = [
        _row("touch", 5000, 20000, 0.1, 0.12),  # given largest first: sizes are sorted
        _row("touch", 100, 500, 0.1, 0.1),
        _row("resend", 100, 500, 0.3, 0.3),
        _row("resend", 1000, 2000, 0.3, 5.0),  # a middle size is not judged
        _row("resend", 5000, 20000, 0.3, 0.6),
    ]
    (figure,) = figures(rows)
    assert figure.figure.startswith("session costs: CPU per call at 5,000 workers and 20,000")
    assert figure.result == "1.50x (resend)"
    assert figure.met
    rows[-1]["postgres"] = 0.7
    (grown,) = figures(rows)
    assert grown.result == "1.67x (resend)" and not grown.met


def test_one_size_alone_makes_no_figure():
    assert figures([_row("touch", 100, 500, 0.1, 0.1)]) == []
