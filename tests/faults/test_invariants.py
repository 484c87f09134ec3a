"""The invariant checker on hand-made rows and events: a consistent history passes, and each
invariant catches its own violation. No database, no process."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tests.faults.invariants import (
    Attempt,
    Cluster,
    Limits,
    Member,
    Row,
    Snapshot,
    Worker,
    check,
    read_events,
)

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
LIMITS = Limits(prepare_timeout=3, pass_interval=1, slack=1)  # 5 s to prepare


def at(secs: float) -> datetime:
    return T0 + timedelta(seconds=secs)


A1, A2, A3, A4 = (f"00000000-0000-4000-8000-00000000000{i}" for i in range(1, 5))


def event(secs: float, worker: str, name: str, attempt: str, job_id: str | None = None) -> dict:
    return {
        "time": at(secs).isoformat(),
        "worker": worker,
        "event": name,
        "attempt": attempt,
        "job_id": job_id,
    }


def history() -> tuple[Snapshot, list[dict]]:
    """Four clusters, seen at t=100: one completed, one running, one preparing, one waiting
    after a failed prepare; and the fleet's events that go with them."""
    snapshot = Snapshot(
        taken_at=at(100),
        clusters=[
            Cluster(1, "Completed"),
            Cluster(2, "Running"),
            Cluster(3, "Queued"),
            Cluster(4, "Queued"),
        ],
        members=[
            Member(1, "eval:a", "Completed"),
            Member(1, "build:b", "Completed"),
            Member(2, "build:c", "Building"),
            Member(3, "build:d", "Building"),
            Member(3, "eval:e", "Queued"),
            Member(4, "build:f", "Queued"),
        ],
        attempts=[
            Attempt(A1, 1, at(10), at(10.5), at(20), "Succeeded"),
            Attempt(A2, 2, at(90), at(90.3)),
            Attempt(A3, 3, at(98)),
            Attempt(A4, 4, at(50), None, at(54), "PrepareFailed"),
        ],
        rows=[
            Row("r1", "eval:a", "w1", at(10), A1, at(19), "Completed", at(10.2)),
            Row("r2", "build:b", "w2", at(10), A1, at(20), "Completed", at(10.4)),
            Row("r3", "build:c", "w3", at(90), A2, None, None, at(90.2)),
            Row("r4", "build:d", "w1", at(98), A3),
            Row("r5", "eval:e", "w2", at(98), A3, None, None, at(98.1)),
            Row("r6", "build:f", "w3", at(50), A4, at(54), "Abandoned"),
            # A single job assigned twice, one after the other.
            Row("s1", "build:s", "w3", at(30), None, at(31), "Abandoned"),
            Row("s2", "build:s", "w1", at(32), None, at(33), "Completed"),
        ],
        workers=[Worker(w, True, at(99)) for w in ("w1", "w2", "w3")],
    )

    events = [
        event(10.1, "w1", "held", A1, "eval:a"),
        event(10.3, "w2", "held", A1, "build:b"),
        event(10.6, "w1", "started", A1, "eval:a"),
        event(10.6, "w2", "started", A1, "build:b"),
        event(90.1, "w3", "held", A2, "build:c"),
        event(90.4, "w3", "started", A2, "build:c"),
        event(98.1, "w2", "held", A3, "eval:e"),
        event(50.1, "w3", "held", A4, "build:f"),
        event(54.1, "w3", "released_hold", A4, "build:f"),
    ]
    return snapshot, events


def violations(snapshot, events, outages=()) -> list[str]:
    return check(snapshot, events, LIMITS, outages)


def with_rows(snapshot: Snapshot, *changed: Row) -> Snapshot:
    by_id = {r.id: r for r in snapshot.rows}
    by_id.update({r.id: r for r in changed})
    return replace(snapshot, rows=list(by_id.values()))


def with_attempts(snapshot: Snapshot, *changed: Attempt) -> Snapshot:
    by_id = {a.id: a for a in snapshot.attempts}
    by_id.update({a.id: a for a in changed})
    return replace(snapshot, attempts=list(by_id.values()))


def only(found: list[str], invariant: str) -> list[str]:
    assert found, "no violation found"
    assert all(v.startswith(invariant + " ") for v in found), found
    return found


def attempt(snapshot, attempt_id) -> Attempt:
    return next(a for a in snapshot.attempts if a.id == attempt_id)


def row(snapshot, row_id) -> Row:
    return next(r for r in snapshot.rows if r.id == row_id)


def test_a_consistent_history_has_no_violation():
    assert violations(*history()) == []


# I1


def test_two_open_rows_for_one_job_key():
    snapshot, events = history()
    second = Row("x", "build:c", "w1", at(95))
    found = only(violations(with_rows(snapshot, second), events), "I1")
    assert any("2 open rows" in v for v in found)


def test_two_rows_of_one_job_open_at_once_in_history():
    snapshot, events = history()
    late = replace(row(snapshot, "s1"), finished_at=at(32.5))  # s2 was dispatched at 32
    [found] = only(violations(with_rows(snapshot, late), events), "I1")
    assert "s1" in found and "s2" in found


# I2


def test_an_attempt_seating_one_worker_twice():
    snapshot, events = history()
    twice = replace(row(snapshot, "r5"), worker="w1")  # r4 of A3 is on w1 already
    [found] = only(violations(with_rows(snapshot, twice), events), "I2")
    assert A3 in found and "w1" in found


def test_a_worker_holding_two_members_of_one_attempt():
    snapshot, events = history()
    events.append(event(10.2, "w1", "held", A1, "build:b"))
    [found] = only(violations(snapshot, events), "I2")
    assert "worker w1 held 2 members" in found


# I3


def test_start_cluster_for_an_attempt_that_never_started():
    snapshot, events = history()
    events.append(event(99, "w2", "started", A3, "eval:e"))
    [found] = only(violations(snapshot, events), "I3")
    assert "never started" in found


def test_start_cluster_for_an_unknown_attempt_or_before_the_start():
    snapshot, events = history()
    unknown = "00000000-0000-4000-8000-000000000099"
    events += [event(99, "w1", "start_ignored", unknown), event(90.0, "w3", "started", A2)]
    found = only(violations(snapshot, events), "I3")
    assert len(found) == 2
    assert "does not exist" in found[0] and "before it started" in found[1]


def test_an_attempt_started_before_every_member_accepted():
    snapshot, events = history()
    unaccepted = replace(row(snapshot, "r2"), accepted_at=None)
    [found] = only(violations(with_rows(snapshot, unaccepted), events), "I3")
    assert A1 in found and "build:b" in found


# I4


def test_a_prepare_open_past_its_timeout_and_one_pass():
    snapshot, events = history()
    stuck = replace(attempt(snapshot, A3), created_at=at(94))  # 6 s open, limit 5
    snapshot = with_attempts(snapshot, stuck)
    [found] = only(violations(snapshot, events), "I4")
    assert A3 in found and "still open" in found
    # The time the passes could not run does not count.
    assert violations(snapshot, events, outages=[(at(95), at(97))]) == []


def test_a_failed_prepare_closed_too_late():
    snapshot, events = history()
    late = replace(attempt(snapshot, A4), finished_at=at(56))
    [found] = only(violations(with_attempts(snapshot, late), events), "I4")
    assert A4 in found and "closed PrepareFailed" in found


def test_an_open_attempt_beside_a_stopped_cluster():
    snapshot, events = history()
    snapshot.clusters[1] = Cluster(2, "Failed")
    snapshot.members[2] = Member(2, "build:c", "Aborted")
    found = violations(snapshot, events)
    assert any(v.startswith("I4") and A2 in v and "Failed" in v for v in found), found


def test_a_running_cluster_without_its_attempt():
    snapshot, events = history()
    closed = replace(attempt(snapshot, A2), finished_at=at(95), outcome="Failed")
    found = violations(with_attempts(snapshot, closed), events)
    assert "I4 cluster 2 is Running without a started open attempt" in found


def test_a_started_attempt_left_open_after_every_report_or_its_workers_loss():
    snapshot, events = history()
    reported = replace(row(snapshot, "r3"), finished_at=at(95), outcome="Completed")
    [found] = only(violations(with_rows(snapshot, reported), events), "I4")
    assert "every member reported" in found

    gone = replace(snapshot, workers=[Worker("w3", False, at(40)), *snapshot.workers[:2]])
    [found] = only(violations(gone, events), "I4")
    assert "worker w3 is gone" in found


# I5


def test_a_member_of_a_finished_cluster_not_settled():
    snapshot, events = history()
    snapshot.members[1] = Member(1, "build:b", "Building")
    [found] = only(violations(snapshot, events), "I5")
    assert "build:b" in found and "not settled" in found


def test_a_member_of_a_waiting_cluster_neither_queued_nor_held():
    snapshot, events = history()
    snapshot.members[5] = Member(4, "build:f", "Building")  # its attempt closed long ago
    [found] = only(violations(snapshot, events), "I5")
    assert "build:f" in found and "not queued" in found


def test_a_member_of_a_running_cluster_that_went_back_to_the_queue():
    snapshot, events = history()
    snapshot.members[2] = Member(2, "build:c", "Queued")
    [found] = only(violations(snapshot, events), "I5")
    assert "not running" in found


def test_a_member_of_a_preparing_cluster_without_a_seat():
    snapshot, events = history()
    rows = [r for r in snapshot.rows if r.id != "r5"]
    events = [e for e in events if e.get("job_id") != "eval:e"]
    [found] = only(violations(replace(snapshot, rows=rows), events), "I5")
    assert "eval:e" in found and "no seat" in found


# Reading the fleet's logs


def test_read_events_skips_a_line_cut_short(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"worker": "w1", "event": "held", "attempt": "a"}\n{"worker": "w2", "ev')
    assert read_events([log, tmp_path / "missing.jsonl"]) == [
        {"worker": "w1", "event": "held", "attempt": "a"}
    ]


@pytest.mark.parametrize("outage", [(at(0), at(1)), (at(99), at(200))])
def test_outages_outside_the_window_do_not_excuse_a_late_prepare(outage):
    snapshot, events = history()
    stuck = with_attempts(snapshot, replace(attempt(snapshot, A3), created_at=at(90)))
    assert violations(stuck, events, outages=[outage])  # 10 s open, 1 s of it excused
