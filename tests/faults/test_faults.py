"""Faults on real processes: two daphne instances, two Celery workers and two beats, on the
suite's own PostgreSQL and Redis, under a fleet of 20 reference workers in three zones (two of
them hang on cluster members, so prepares time out now and then) and a steady load of clusters
and single jobs.

Each fault is injected while some attempts are preparing and some running (read from the
database), the killed process is started again, and the system must converge: no prepare
left open past its deadline, every member job settled, queued or held by its attempt, and new
clusters completing. Then the invariant checker (tests/faults/invariants.py) must find nothing
in the whole history so far: the tests share one stack and build on each other's history.
"""

import time
from datetime import UTC, datetime

import pytest

from tests.faults.conftest import RESULTS, logs_hint
from tests.faults.invariants import Limits, check, load_snapshot, read_events
from tests.faults.services import wait_until
from tests.faults.stack import (
    DISPATCH_INTERVAL_SECS,
    FLEET_PROCESSES,
    HUNG_IN,
    PREPARE_TIMEOUT_SECS,
    WORKERS_PER_PROCESS,
    Stack,
)

pytestmark = pytest.mark.e2e  # real processes over real sockets

LIMITS = Limits(prepare_timeout=PREPARE_TIMEOUT_SECS, pass_interval=DISPATCH_INTERVAL_SECS)
WORKERS = FLEET_PROCESSES * WORKERS_PER_PROCESS
STATE_TIMEOUT = 60.0  # to see attempts preparing and running at once (and the fault's target)
CONVERGE_TIMEOUT = 90.0
NEW_CLUSTERS_COMPLETED = 3  # "progress resumes"

OUTAGES: list[tuple[datetime, datetime]] = []  # when the passes could not run


def utcnow() -> datetime:
    return datetime.now(UTC)


# Reading the state

PREPARING_AND_RUNNING_SQL = """
SELECT count(*) FILTER (WHERE started_at IS NULL), count(*) FILTER (WHERE started_at IS NOT NULL)
FROM cluster_attempt WHERE finished_at IS NULL
"""
# A member that accepted, in a running attempt, or in a preparing one that will stay so a
# while: fresh, and waiting for a hung worker that never answers.
SEATED_SQL = """
SELECT w.name, a.id::text FROM dispatched_job d
JOIN worker w ON w.id = d.worker_id
JOIN cluster_attempt a ON a.id = d.cluster_attempt_id
WHERE d.finished_at IS NULL AND a.finished_at IS NULL AND d.accepted_at IS NOT NULL
  AND CASE WHEN %(preparing)s THEN a.started_at IS NULL
      AND a.created_at > now() - interval '1.5 seconds'
      AND EXISTS (SELECT 1 FROM dispatched_job h JOIN worker hw ON hw.id = h.worker_id
                  WHERE h.cluster_attempt_id = a.id AND h.accepted_at IS NULL
                    AND h.finished_at IS NULL AND hw.name = ANY(%(hung)s))
      ELSE a.started_at IS NOT NULL END
ORDER BY a.created_at DESC
"""
# The session that holds the dispatch pass's advisory lock (a bigint key: classid is its high
# 32 bits, objid its low 32), named by its process's PGAPPNAME.
PASS_HOLDER_SQL = """
SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s
"""


def preparing_and_running(stack: Stack) -> bool:
    preparing, running = stack.query(PREPARING_AND_RUNNING_SQL)[0]
    return preparing > 0 and running > 0


def seated(stack: Stack, preparing: bool) -> tuple[str, str] | None:
    """(worker, attempt) of a member that accepted, in a preparing or a running attempt."""
    rows = stack.query(SEATED_SQL, {"preparing": preparing, "hung": hung_workers()})
    return rows[0] if rows else None


def hung_workers() -> list[str]:
    return [f"f{i}-{n}" for i, hung in HUNG_IN.items() for n in range(hung)]


def reconnected(stack: Stack, fleet: str, since: datetime) -> bool:
    """Every worker of that fleet process got an InitAck after `since`."""
    i = int(fleet.split("-")[1])
    back = {
        e["worker"]
        for e in read_events([stack.events_path(i)])
        if e["event"] == "init_ack" and datetime.fromisoformat(e["time"]) > since
    }
    return len(back) == WORKERS_PER_PROCESS


def pass_holder(stack: Stack) -> str | None:
    from clusters.dispatch import PASS_LOCK

    rows = stack.query(PASS_HOLDER_SQL, [PASS_LOCK >> 32, PASS_LOCK & 0xFFFF_FFFF])
    return rows[0][0] if rows and rows[0][0].startswith("celery-") else None


def when(stack: Stack, find, what: str):
    """Polls until attempts are preparing and running at once and `find` names a target."""

    def ready():
        if not preparing_and_running(stack):
            return None
        return find()

    return wait_until(ready, STATE_TIMEOUT, what, every=0.01)


def dispatch_passes(stack: Stack) -> int:
    """Dispatch passes the Celery workers finished so far, from their logs."""
    return sum(
        1
        for i in range(2)
        for line in (stack.logs / f"celery-{i}.log").read_text(errors="replace").splitlines()
        if "clusters.dispatch[" in line and "succeeded" in line
    )


def connected_workers(stack: Stack) -> int:
    return stack.query("SELECT count(*) FROM worker WHERE channel_name IS NOT NULL")[0][0]


def clusters_completed_since(stack: Stack, since: datetime) -> int:
    return stack.query(
        "SELECT count(*) FROM cluster_job WHERE status = 'Completed' AND created_at > %s",
        [since],
    )[0][0]


def attempt_outcome(stack: Stack, attempt: str) -> str | None:
    rows = stack.query("SELECT outcome FROM cluster_attempt WHERE id = %s", [attempt])
    return rows[0][0] if rows else None


def violations(stack: Stack) -> list[str]:
    # The events first: each was logged before the snapshot, so a StartCluster seen was sent
    # after its attempt's start committed and the snapshot holds that start. Read after, they
    # may show an attempt the snapshot still has preparing, or not yet at all.
    events = read_events(stack.event_files())
    snapshot = stack.retry(lambda: load_snapshot(stack.db()))
    return check(snapshot, events, LIMITS, OUTAGES)


def converge(stack: Stack, healed: datetime) -> tuple[float, list[str]]:
    """Waits for new clusters to complete and the checker to find nothing; the seconds it
    took and what the checker found last."""
    began = time.monotonic()
    found: list[str] = ["not checked yet"]
    while time.monotonic() - began < CONVERGE_TIMEOUT:
        if clusters_completed_since(stack, healed) >= NEW_CLUSTERS_COMPLETED:
            found = violations(stack)
            if not found:
                break
        time.sleep(0.5)
    return time.monotonic() - began, found


# Faults

PHASES = {"prepare": True, "run": False}


def inject(stack: Stack, fault: str, phase: str, services) -> dict:
    """Injects one fault at the right moment and starts again what it killed. What was hit."""
    postgres, redis, _ = services
    hit: dict = {}
    if fault in ("worker", "daphne"):
        worker, attempt = when(
            stack, lambda: seated(stack, PHASES[phase]), f"a member {phase}ing to hit"
        )
        victim = stack.fleet_process_of(worker) if fault == "worker" else stack.daphne_of(worker)
        hit.update(victim=victim, via=worker, attempt=attempt)
        stack.kill(victim)
        hit["at"] = utcnow()
        stack.start(victim)
        stack.wait_ready(victim)
        if fault == "worker":
            wait_until(lambda: reconnected(stack, victim, hit["at"]), 90, f"{victim} back")
        return hit
    passes = dispatch_passes(stack)
    if fault == "celery":
        victim = when(stack, lambda: pass_holder(stack), "a dispatch pass running")
        hit["victim"] = victim
        stack.kill(victim)
        hit["at"] = utcnow()
        stack.start(victim)
        stack.wait_ready(victim)
    else:
        when(stack, lambda: True, "attempts preparing and running")
        hit["at"] = utcnow()
        (redis if fault == "redis" else postgres).restart()
    # Until a pass ran again, prepares could not expire: that time does not count (I4).
    wait_until(lambda: dispatch_passes(stack) > passes, 60, "a dispatch pass after the fault")
    OUTAGES.append((hit["at"], utcnow()))
    return hit


SCENARIOS = [
    ("worker", "prepare"),
    ("worker", "run"),
    ("daphne", "prepare"),
    ("daphne", "run"),
    ("celery", "pass"),
    ("redis", "prepare+run"),
    ("postgres", "prepare+run"),
]


def test_the_stack_runs_clean_before_any_fault(stack):
    wait_until(lambda: connected_workers(stack) == WORKERS, 90, "the fleet connected")
    when(stack, lambda: True, "attempts preparing and running")
    took, found = converge(stack, utcnow())
    RESULTS.append({"fault": "none", "converged_s": round(took, 1), "violations": len(found)})
    assert found == [], f"{found[:20]} {logs_hint(stack)}"


@pytest.mark.parametrize(("fault", "phase"), SCENARIOS, ids=[f"{f}-{p}" for f, p in SCENARIOS])
def test_the_system_converges_after(stack, services, fault, phase):
    stack.heal()  # whatever an earlier failure left down
    hit = inject(stack, fault, phase, services)
    healed = utcnow()
    took, found = converge(stack, healed)
    dead = stack.dead()  # after: a process that died while the system converged is named
    result = {"fault": fault, "phase": phase, **{k: v for k, v in hit.items() if k != "at"}}
    if "attempt" in hit:
        result["attempt_outcome"] = attempt_outcome(stack, hit["attempt"])
    if fault == "daphne":
        result["moved"] = moved_workers(stack, hit)
    result.update(converged_s=round(took, 1), violations=len(found))
    RESULTS.append(result)
    assert dead == [], f"{dead} died after the fault {logs_hint(stack)}"
    assert found == [], f"{found[:20]} {logs_hint(stack)}"
    if "attempt" in hit:  # the attempt the fault hit was decided
        expected = {"PrepareFailed"} if phase == "prepare" else {"Succeeded", "Failed", "Aborted"}
        assert result["attempt_outcome"] in expected
    if fault == "daphne":
        assert result["moved"] > 0


def moved_workers(stack: Stack, hit: dict) -> int:
    """Workers that reconnected to the other daphne after the kill."""
    killed = stack.urls[int(hit["victim"].split("-")[1])]
    moved = {
        e["worker"]
        for e in read_events(stack.event_files())
        if e["event"] == "connected"
        and e.get("url") not in (None, killed)
        and datetime.fromisoformat(e["time"]) > hit["at"]
    }
    return len(moved)


# What holds a cluster back, for the failure message: its attempts and its members' jobs.
UNFINISHED_SQL = """
SELECT c.id, c.status, c.attempts, c.retry_budget,
       (SELECT array_agg(a.outcome || '/' || (a.started_at IS NOT NULL) || '/'
                         || (a.finished_at IS NOT NULL) ORDER BY a.created_at)
        FROM cluster_attempt a WHERE a.cluster_job_id = c.id),
       (SELECT array_agg(coalesce(e.status, b.status) ORDER BY m.id)
        FROM cluster_member m
        LEFT JOIN evaluation e ON e.id = m.evaluation_id
        LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
        WHERE m.cluster_job_id = c.id)
FROM cluster_job c
WHERE c.status IN ('Queued', 'Running')
   OR EXISTS (SELECT 1 FROM cluster_attempt a
              WHERE a.cluster_job_id = c.id AND a.finished_at IS NULL)
ORDER BY c.id LIMIT 10
"""


def unfinished(stack: Stack) -> list:
    """(cluster, status, attempts, budget, attempts as outcome/started/finished, member jobs)."""
    return stack.query(UNFINISHED_SQL)


def test_after_the_load_stops_every_cluster_finishes_and_the_history_is_clean(stack):
    stack.heal()
    stack.stop("load")

    def drained():
        return stack.query(
            "SELECT NOT EXISTS (SELECT 1 FROM cluster_job WHERE status IN ('Queued', 'Running'))"
            " AND NOT EXISTS (SELECT 1 FROM cluster_attempt WHERE finished_at IS NULL)"
        )[0][0]

    try:
        wait_until(drained, 120, "every cluster finished")
    except TimeoutError as e:
        held = f"{unfinished(stack)} dead={stack.dead()}"
        raise AssertionError(f"{e}: {held} {logs_hint(stack)}") from e
    found = violations(stack)
    totals = dict(stack.query("SELECT status, count(*) FROM cluster_job GROUP BY status"))
    outcomes = dict(stack.query("SELECT outcome, count(*) FROM cluster_attempt GROUP BY outcome"))
    singles = stack.query(
        "SELECT count(*) FROM dispatched_job WHERE cluster_attempt_id IS NULL"
        " AND outcome = 'Completed'"
    )[0][0]
    RESULTS.append(
        {
            "fault": "drained",
            **{f"clusters_{k}": v for k, v in totals.items()},
            **{f"attempts_{k}": v for k, v in outcomes.items()},
            "singles_completed": singles,
            "violations": len(found),
        }
    )
    assert found == [], f"{found[:20]} {logs_hint(stack)}"
    assert [name for name in stack.dead() if name != "load"] == []
