"""The spec's Prepare and Start, and Signals: acceptances, rejections, held members' failures,
StartCluster with the roster, AbortCluster, and forwarding ClusterSignal.

Every decision is a transaction that re-reads the rows it decides on; messages to workers go
out after the commit that justifies them.
"""

import logging
import uuid

from django.db import connection
from django.utils import timezone

from clusters.claim import fail_prepare_attempt, start_cluster_attempt
from clusters.models import ClusterAttempt, ClusterMember
from clusters.tracking import role_indexes
from gradient import metrics
from gradient.errors import NotAllowed
from gradient.jobs.models import DispatchedJob
from gradient.logs import ids
from workers.groups import send_frames
from workers.protocol import (
    AbortCluster,
    ForwardedSignal,
    MemberRef,
    RosterEntry,
    StartCluster,
)

log = logging.getLogger(__name__)


def _seats(attempt_id) -> list[tuple[DispatchedJob, str, int]]:
    """The attempt's rows with each member's (role, index), in roster order."""
    rows = list(
        DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).select_related("worker")
    )
    cluster_id = ClusterAttempt.objects.values_list("cluster_job_id", flat=True).get(pk=attempt_id)
    indexes = role_indexes(ClusterMember.objects.filter(cluster_job_id=cluster_id))
    seats = [(row, *indexes.get(row.job_id, ("?", 0))) for row in rows]
    return sorted(seats, key=lambda s: (s[1], s[2]))


ACCEPT_SQL = """
UPDATE dispatched_job SET accepted_at = coalesce(accepted_at, %s)
WHERE worker_id = %s AND job_id = %s AND finished_at IS NULL AND cluster_attempt_id IS NOT NULL
RETURNING cluster_attempt_id
"""


def member_accepted(worker_id: int, job_id: str) -> bool:
    """Record a member's acceptance; the last one starts the attempt and sends every member
    StartCluster with the roster. True when this acceptance started it."""
    # One statement, its own transaction: the acceptance of an open member row, kept as first
    # given.
    with connection.cursor() as cursor:
        cursor.execute(ACCEPT_SQL, [timezone.now(), worker_id, job_id])
        row = cursor.fetchone()
    if row is None:
        raise NotAllowed(f"{job_id} is not held by this worker")
    attempt_id = row[0]
    waiting = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).exclude(
        finished_at__isnull=True, accepted_at__isnull=False
    )
    if waiting.exists() or not start_cluster_attempt(attempt_id):
        return False
    seats = _seats(attempt_id)
    roster = [
        RosterEntry(
            role=role,
            index=index,
            worker=row.worker.name,
            zone=row.worker.zone,
            endpoint=row.worker.endpoint,
        )
        for row, role, index in seats
    ]
    start = StartCluster(attempt=str(attempt_id), roster=roster)
    send_frames([(row.worker_id, start) for row, _, _ in seats])
    log.info(
        "attempt %s started with %d members",
        attempt_id,
        len(seats),
        extra=ids(attempt=attempt_id, worker=[row.worker_id for row, _, _ in seats]),
    )
    return True


def abort_prepare(attempt_id, reason: str) -> bool:
    """A reject, the prepare timeout, or a held member's failure: the attempt closes
    PrepareFailed and every member is told to drop its hold. False when the attempt had
    started or closed already (then this is not a failed prepare)."""
    if not fail_prepare_attempt(attempt_id):
        return False
    notify_abort(attempt_id, reason)
    log.info("attempt %s prepare failed: %s", attempt_id, reason, extra=ids(attempt=attempt_id))
    return True


def notify_abort(attempt_id, reason: str, workers=None) -> None:
    """AbortCluster to the given workers, by default every worker seated in the attempt."""
    if workers is None:
        workers = DispatchedJob.objects.filter(cluster_attempt_id=attempt_id).values_list(
            "worker_id", flat=True
        )
    message = AbortCluster(attempt=str(attempt_id), reason=reason)
    send_frames([(w, message) for w in sorted(set(workers))])


def member_rejected(worker_id: int, job_id: str, reason: str | None) -> None:
    row = (
        DispatchedJob.objects.filter(
            worker_id=worker_id,
            job_id=job_id,
            finished_at__isnull=True,
            cluster_attempt__isnull=False,
        )
        .values("cluster_attempt_id")
        .first()
    )
    if row is None:
        raise NotAllowed(f"{job_id} is not held by this worker")
    abort_prepare(row["cluster_attempt_id"], f"member {job_id} rejected: {reason or 'no reason'}")


def forward_signal(worker_id: int, attempt: str, to: MemberRef | None, payload) -> int:
    """Forward a ClusterSignal within a started attempt, from one of its members, to the member
    named by `to` or else to every other member. Returns how many got it."""
    attempt_id = uuid.UUID(attempt)
    is_started = ClusterAttempt.objects.filter(
        pk=attempt_id, started_at__isnull=False, finished_at__isnull=True
    ).exists()
    if not is_started:
        raise NotAllowed("signals are forwarded only within a started attempt")
    seats = [s for s in _seats(attempt_id) if s[0].finished_at is None]
    sender = next((s for s in seats if s[0].worker_id == worker_id), None)
    if sender is None:
        raise NotAllowed("only a member of the attempt can signal it")
    if to is None:
        targets = [s for s in seats if s is not sender]
    else:
        targets = [s for s in seats if (s[1], s[2]) == (to.role, to.index)]
        if not targets:
            raise NotAllowed(f"no member {to.role}/{to.index} in this attempt")
    message = ForwardedSignal(
        attempt=attempt, **{"from": MemberRef(role=sender[1], index=sender[2])}, payload=payload
    )
    send_frames([(row.worker_id, message) for row, _, _ in targets])
    metrics.count_signal_forwarded()
    return len(targets)
