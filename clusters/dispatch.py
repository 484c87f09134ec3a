"""The cluster-dispatch pass: expire overdue prepares, then place every cluster that can start
(prioritized first, then the oldest), take each placement's seats and claim it in one
transaction, and send every seat its AssignJob with the hold.

It runs every GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS and whenever a RequestJob goes
unanswered. Any number may be started at once: one at a time does the work (an advisory lock),
and each claim re-checks what it takes, so a second pass could only lose its claims.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import redis
from django.conf import settings
from django.db import connection, connections
from django.utils import timezone

from clusters import planner, reservation
from clusters.claim import ClusterClaim, claim_cluster
from clusters.recovery import expire_overdue_prepares
from clusters.tracking import (
    MemberRow,
    StartableCluster,
    planned_cluster,
    planned_worker,
    startable_clusters,
)
from gradient import metrics
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import JobKind
from gradient.logs import ids
from workers.groups import send_frames
from workers.protocol import AssignJob, ClusterHold, JobSpec

log = logging.getLogger(__name__)

PASS_LOCK = 0x6772_6164_6973  # advisory lock key of the dispatch pass
MEMBER_STEPS = {
    JobKind.EVAL: ["fetch", "evaluate_flake", "evaluate_derivations"],  # never split
    JobKind.BUILD: ["build"],
}


@dataclass
class PassResult:
    expired: int = 0
    ready: int = 0
    placed: int = 0
    claimed: list = field(default_factory=list)
    seconds: float = 0.0
    skipped: bool = False
    reservation: str | None = None


# The connected workers with a live idle slot, with what the planner asks of them.
IDLE_WORKERS_SQL = """
SELECT w.id, w.name, w.zone, w.architectures, w.system_features, w.all_projects,
       w.can_eval, w.can_build, array_agg(s.kind)
FROM idle_slot s
JOIN worker w ON w.id = s.worker_id
WHERE s.recorded_at >= %(fresh)s
  AND w.channel_name IS NOT NULL AND NOT w.draining AND w.revoked_at IS NULL
  AND w.id <> ALL(%(reserved)s::bigint[])
GROUP BY w.id
ORDER BY w.id
"""

# Answered scores of the members' jobs, one row per job: its (worker id, size) pairs packed as
# big-endian int64s, so a million pairs cost a few bytes objects instead of a million tuples.
# Scores of workers without an idle slot come along: the planner drops workers it does not
# know (a filter on worker_id here makes PostgreSQL walk the worker index, far slower).
SCORES_SQL = """
SELECT job_id, string_agg(int8send(worker_id) || int8send(missing_nar_size), ''::bytea)
FROM job_score
WHERE job_id = ANY(%s::text[]) AND missing_nar_size IS NOT NULL
GROUP BY job_id
"""


class _IdleWorker(NamedTuple):
    """A row of IDLE_WORKERS_SQL, with the names planned_worker reads."""

    pk: int
    name: str
    zone: str | None
    architectures: list[str]
    system_features: list[str]
    all_projects: bool
    can_eval: bool
    can_build: bool
    kinds: list[str]


def snapshot(clusters: list[StartableCluster], now, reserved=()) -> planner.Snapshot:
    """What the planner needs, read in three queries of plain rows: the connected workers
    with a live idle slot (but for the `reserved` ones), and their scores for the members'
    jobs."""
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
    keys = [m.key for c in clusters for m in c.members]
    access: dict[int, set[int]] = {}
    scores: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with connection.cursor() as cursor:
        cursor.execute(IDLE_WORKERS_SQL, {"fresh": now - ttl, "reserved": list(reserved)})
        idle = [_IdleWorker._make(row) for row in cursor.fetchall()]
        limited = [w.pk for w in idle if not w.all_projects]
        if limited:
            cursor.execute(
                "SELECT worker_id, project_id FROM worker_projects WHERE worker_id = ANY(%s)",
                [limited],
            )
            for worker_id, project_id in cursor.fetchall():
                access.setdefault(worker_id, set()).add(project_id)
        if idle and keys:
            cursor.execute(SCORES_SQL, [keys])
            for job_id, packed in cursor.fetchall():
                pairs = np.frombuffer(packed, dtype=">i8").reshape(-1, 2)
                scores[job_id] = (pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64))
    return planner.Snapshot(
        clusters=tuple(planned_cluster(c) for c in clusters),
        workers=tuple(planned_worker(w, w.kinds, frozenset(access.get(w.pk, ()))) for w in idle),
        scores={},
        score_arrays=scores,
    )


def hold_secs() -> int:
    # A worker never hearing StartCluster releases the slot on its own, a little after the
    # server has given up on the prepare.
    return int(settings.GRADIENT["CLUSTER_PREPARE_TIMEOUT_SECS"]) + 10


def claim_placement(placement: planner.Placement, rows: dict[str, MemberRow], since) -> list:
    """Take the seats and claim the cluster in one transaction; the AssignJob frames to send
    (empty when the claim was lost: nothing written, the members wait for the next pass)."""
    members = [(seat, rows[seat.member.key]) for seat in placement.seats]
    claim = ClusterClaim(
        cluster_id=placement.cluster_id,
        members=[
            Assignment(
                gate=ClaimGate(row.kind, row.job, row.substitute),
                worker_id=seat.worker.id,
                project_id=row.project_id,
                steps=MEMBER_STEPS[row.kind],
                missing_nar_size=seat.missing_nar_size,
            )
            for seat, row in members
        ],
        idle_seats=[(seat.worker.id, row.kind) for seat, row in members],
        idle_since=since,
    )
    if not claim_cluster(claim):
        return []
    frames = []
    for assignment, (seat, row) in zip(claim.members, members, strict=True):
        frames.append(
            (
                seat.worker.id,
                AssignJob(
                    job_id=row.key,
                    assignment_id=str(assignment.id),
                    job=JobSpec(
                        kind=row.kind,
                        project=row.project,
                        evaluation=str(row.job) if row.kind == JobKind.EVAL else None,
                        build=str(row.job) if row.kind == JobKind.BUILD else None,
                        architecture=row.architecture,
                        required_features=list(row.features),
                        steps=assignment.steps,
                    ),
                    cluster=ClusterHold(
                        attempt=str(claim.attempt_id),
                        role=row.role,
                        index=row.index,
                        hold_secs=hold_secs(),
                    ),
                ),
            )
        )
    log.info(
        "cluster %s claimed as attempt %s",
        placement.cluster_id,
        claim.attempt_id,
        extra=ids(
            cluster=placement.cluster_id,
            attempt=claim.attempt_id,
            worker=[seat.worker.id for seat, _ in members],
        ),
    )
    return frames


def _claim_and_send(placement: planner.Placement, rows: dict, since) -> bool:
    frames = claim_placement(placement, rows, since)
    if frames:
        send_frames(frames)
    return bool(frames)


class _Outbox:
    """AssignJob frames of the claims made so far, sent together: every send_frames call pays
    for an event loop of its own, too much once per claim when a pass makes a thousand. The
    first frame waits at most FLUSH_SECS plus one claim, and a pass sends what is left as it
    ends."""

    FLUSH_SECS = 0.05

    def __init__(self):
        self.frames: list = []
        self.since = 0.0

    def add(self, frames: list) -> None:
        if not self.frames:
            self.since = time.monotonic()
        self.frames += frames
        if time.monotonic() - self.since >= self.FLUSH_SECS:
            self.flush()

    def flush(self) -> None:
        if self.frames:
            frames, self.frames = self.frames, []
            send_frames(frames)


# A pass with many placements claims them on a few threads, each with its own database
# connection, closed when the pass is done: every claim is a transaction of several round
# trips, and one by one a thousand of them take seconds. Placements never share a worker or a
# job, so the claims touch disjoint rows and cannot wait on each other.
CLAIM_THREADS = 4
CLAIM_THREADS_FROM = 16  # placements; fewer are claimed one by one


def _claim_all(placements: list[planner.Placement], rows: dict, since) -> set[int]:
    """Claim every placement and send the AssignJobs of those won; the clusters claimed."""
    claimed: set[int] = set()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for placement in placements:
        todo.put(placement)
    failures: list[BaseException] = []

    def claim_some(own_connection: bool) -> None:
        outbox = _Outbox()
        try:
            while True:
                try:
                    placement = todo.get_nowait()
                except queue.Empty:
                    return
                frames = claim_placement(placement, rows, since)
                if frames:
                    outbox.add(frames)
                    claimed.add(placement.cluster_id)
        except BaseException as exc:
            failures.append(exc)
        finally:
            outbox.flush()
            if own_connection:
                connections.close_all()

    # Inside a transaction (a test's) other connections would not see its rows.
    if len(placements) < CLAIM_THREADS_FROM or connection.in_atomic_block:
        claim_some(own_connection=False)
    else:
        threads = [
            threading.Thread(target=claim_some, args=(True,), name=f"claim-{i}")
            for i in range(CLAIM_THREADS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return claimed


def age_reservations(ready, claimed: set[int], rows: dict, since, now) -> str | None:
    """Release a stale reservation, commit the active one once its seats are idle, or let the
    oldest overdue cluster reserve. What happened, for the pass's result."""
    released = reservation.release_stale(now)
    active = reservation.active_reservation()
    if active is not None:
        placement = reservation.committable(active, {c.id: c for c in ready}, now)
        if placement is not None and _claim_and_send(placement, rows, since):
            claimed.add(active.cluster_job_id)
            reservation.release(active.pk, "committed")
            return "committed"
        return f"released: {released}" if released else "holding"
    for cluster in reservation.due(ready, claimed, now):
        target = reservation.target(cluster, now)
        if target is not None and reservation.reserve(target, now) is not None:
            return "reserved"
    return f"released: {released}" if released else None


def _try_lock(wait: bool) -> bool:
    with connection.cursor() as cursor:
        if wait:
            # A woken pass waits for the running one: the wake-up may carry its new idle slot.
            cursor.execute("SET lock_timeout = '10s'")
            try:
                cursor.execute("SELECT pg_advisory_lock(%s)", [PASS_LOCK])
                return True
            except Exception:
                return False
            finally:
                cursor.execute("RESET lock_timeout")
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [PASS_LOCK])
        return cursor.fetchone()[0]


def run_pass(wait: bool = False) -> PassResult:
    began = time.monotonic()
    result = PassResult()
    if not _try_lock(wait):
        result.skipped = True
        return result
    try:
        result.expired = len(expire_overdue_prepares())
        now = timezone.now()
        since = now - timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
        ready = startable_clusters(now)
        result.ready = len(ready)
        rows = {m.key: m for c in ready for m in c.members}
        # Other clusters plan over the unreserved idle workers.
        placements = planner.plan(snapshot(ready, now, reservation.reserved_workers()))
        result.placed = len(placements)
        claimed = _claim_all(placements, rows, since)
        result.claimed = [p.cluster_id for p in placements if p.cluster_id in claimed]
        result.reservation = age_reservations(ready, set(result.claimed), rows, since, now)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [PASS_LOCK])
        result.seconds = time.monotonic() - began
        metrics.observe_dispatch_pass(result.seconds)
    return result


# Wake-ups: coalesced in Redis so a burst of unanswered RequestJobs queues one pass.

WAKE_KEY = "gradient:dispatch:queued"
_redis = None


def _client():
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1)
    return _redis


def wake_dispatch() -> bool:
    """Queue a dispatch pass unless one is queued and not yet started. Best effort: losing
    Redis loses only wake-ups, which the periodic pass makes up for."""
    from clusters.tasks import dispatch

    try:
        if not _client().set(WAKE_KEY, 1, nx=True, ex=10):
            return False
        dispatch.delay(woken=True)
    except Exception:
        log.warning("could not wake the dispatch pass", exc_info=True)
        return False
    return True


def clear_wake() -> None:
    """Called as a woken pass starts: a wake-up from now on queues another pass."""
    try:
        _client().delete(WAKE_KEY)
    except Exception:
        log.warning("could not clear the dispatch wake-up", exc_info=True)
