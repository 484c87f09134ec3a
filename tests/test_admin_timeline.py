"""The cluster page's time axis: every attempt on one axis, an open one running to now,
bars coloured by outcome, durations read at a glance."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from clusters.cluster_page import duration, timeline
from clusters.models import AttemptOutcome

pytestmark = pytest.mark.django_db


T0 = datetime(2030, 1, 2, 10, 0, tzinfo=UTC)


def times(created, started=None, finished=None, outcome=None):
    """An attempt as timeline() reads it, minutes after T0."""
    at = lambda minutes: None if minutes is None else T0 + timedelta(minutes=minutes)  # noqa: E731
    return SimpleNamespace(
        created_at=at(created), started_at=at(started), finished_at=at(finished), outcome=outcome
    )


def place(bar):
    return {k: bar[k] for k in ("left", "width", "started", "run_width", "state")}


def test_the_timeline_puts_every_attempt_on_one_axis_from_the_first_creation_to_the_last_finish():
    line = timeline(
        [
            times(0, finished=10, outcome=AttemptOutcome.PREPARE_FAILED),
            times(20, started=22, finished=40, outcome=AttemptOutcome.SUCCEEDED),
        ],
        now=T0 + timedelta(hours=5),  # nothing open: now plays no part
    )
    assert (line["start"], line["end"], line["to_now"]) == (T0, T0 + timedelta(minutes=40), False)
    assert [place(b) for b in line["bars"]] == [
        {"left": 0, "width": 25, "started": None, "run_width": None, "state": "PrepareFailed"},
        {"left": 50, "width": 50, "started": 55, "run_width": 45, "state": "Succeeded"},
    ]
    assert [(t["at"], t["label"]) for t in line["ticks"]] == [
        (0, "10:00"),
        (25, "10:10"),
        (50, "10:20"),
        (75, "10:30"),
        (100, "10:40"),
    ]


def test_an_open_attempt_runs_to_now_and_the_axis_with_it():
    now = T0 + timedelta(minutes=60)
    line = timeline([times(0, 1, 20, AttemptOutcome.FAILED), times(30, 33)], now=now)
    assert (line["end"], line["to_now"]) == (now, True)
    failed, running = line["bars"]
    assert place(failed) == {
        "left": 0,
        "width": 33.333,
        "started": 1.667,
        "run_width": 31.666,
        "state": "Failed",
    }
    assert place(running) == {
        "left": 50,
        "width": 50,
        "started": 55,
        "run_width": 45,
        "state": "open",
    }
    assert running["open"] and running["ran_for"] == timedelta(minutes=27)
    # Still preparing: the whole bar is the prepare part, up to now.
    [held] = timeline([times(0)], now=T0 + timedelta(seconds=30))["bars"]
    assert place(held) == {
        "left": 0,
        "width": 100,
        "started": None,
        "run_width": None,
        "state": "open",
    }


@pytest.mark.parametrize(
    ("outcome", "colour"),
    [
        (AttemptOutcome.SUCCEEDED, "#2e9d4f"),  # green
        (AttemptOutcome.FAILED, "#d0413c"),  # red
        (AttemptOutcome.PREPARE_FAILED, "#f0a01e"),  # amber
        (AttemptOutcome.ABORTED, "#8b8f94"),  # grey
        (None, "#2f7ed8"),  # open: blue
    ],
)
def test_a_bar_is_coloured_by_its_outcome(outcome, colour):
    finished = None if outcome is None else 5
    [bar] = timeline([times(0, 1, finished, outcome)], now=T0 + timedelta(minutes=9))["bars"]
    assert bar["colour"] == colour


def test_an_instant_attempt_is_still_drawn_and_no_attempts_draw_nothing():
    [bar] = timeline([times(0, finished=0, outcome=AttemptOutcome.ABORTED)], now=T0)["bars"]
    assert (bar["left"], bar["width"]) == (0, 0)
    assert bar["draw_width"] > 0
    line = timeline([times(0, 0, 10, "Failed"), times(10, finished=10, outcome="Aborted")], T0)
    last = line["bars"][-1]
    assert (last["left"], last["width"]) == (100, 0)
    assert last["draw_left"] + last["draw_width"] == 100  # kept inside the axis
    assert timeline([], now=T0) is None


def test_durations_read_at_a_glance():
    assert [
        duration(timedelta(seconds=s)) for s in (0, 3, 62, 3600 + 5 * 60 + 9, 2 * 86400 + 3 * 3600)
    ] == ["0s", "3s", "1m 02s", "1h 05m", "2d 3h"]
