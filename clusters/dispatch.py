"""The cluster-dispatch pass: expire overdue prepares, then place every cluster that can start
(prioritized first, then the oldest), take each placement's seats and claim it in one
transaction, and send every seat its AssignJob with the hold.

It runs every GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS and whenever a RequestJob goes
unanswered. Any number may be started at once: one at a time does the work (an advisory lock),
and each claim re-checks what it takes, so a second pass could only lose its claims.
"""

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

import redis
from django.conf import settings
from django.db import connection
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
from workers.models import IdleSlot, JobScore, Worker
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


def snapshot(clusters: list[StartableCluster], now, reserved=()) -> planner.Snapshot:
    """What the planner needs, read in a few queries: the connected workers with a live idle
    slot (but for the `reserved` ones), and their scores for the members' jobs."""
    ttl = timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])
    idle: dict[int, set[str]] = {}
    for worker_id, kind in (
        IdleSlot.objects.filter(
            recorded_at__gte=now - ttl,
            worker__channel_name__isnull=False,
            worker__draining=False,
            worker__revoked_at__isnull=True,
        )
        .exclude(worker_id__in=list(reserved))
        .values_list("worker_id", "kind")
    ):
        idle.setdefault(worker_id, set()).add(kind)
    access: dict[int, set[int]] = {}
    for worker_id, project_id in Worker.projects.through.objects.filter(
        worker_id__in=list(idle)
    ).values_list("worker_id", "project_id"):
        access.setdefault(worker_id, set()).add(project_id)
    workers = tuple(
        planned_worker(w, idle[w.pk], frozenset(access.get(w.pk, ())))
        for w in Worker.objects.filter(pk__in=list(idle)).order_by("pk")
    )
    keys = [m.key for c in clusters for m in c.members]
    scores: dict[str, dict[int, int]] = {}
    for worker_id, job_id, size in JobScore.objects.filter(
        worker_id__in=list(idle), job_id__in=keys, missing_nar_size__isnull=False
    ).values_list("worker_id", "job_id", "missing_nar_size"):
        scores.setdefault(job_id, {})[worker_id] = size
    return planner.Snapshot(
        clusters=tuple(planned_cluster(c) for c in clusters),
        workers=workers,
        scores={},
        scores_by_job=scores,
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
        for placement in placements:
            if _claim_and_send(placement, rows, since):
                result.claimed.append(placement.cluster_id)
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
