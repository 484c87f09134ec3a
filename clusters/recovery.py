"""Recovery sweeps: bring every cluster back to a consistent state from the database alone.

Safe to run at start-up and at any time, from any number of processes at once: each step is
one of the claim module's transactions, which re-check what they change. Deadlines are
computed from stored times (an attempt's created_at), so a restart never resets one.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from clusters.claim import (
    bound_lock_waits,
    can_retry,
    dead_member_count,
    fail_prepare_attempt,
    resolve_cluster_attempt,
    set_cluster_status,
)
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus

log = logging.getLogger(__name__)


def expire_overdue_prepares(now=None) -> list:
    """Open, unstarted attempts past their prepare deadline close PrepareFailed."""
    now = now or timezone.now()
    deadline = now - timedelta(seconds=settings.GRADIENT["CLUSTER_PREPARE_TIMEOUT_SECS"])
    overdue = ClusterAttempt.objects.filter(
        finished_at__isnull=True, started_at__isnull=True, created_at__lt=deadline
    ).values_list("pk", flat=True)
    return [pk for pk in overdue if fail_prepare_attempt(pk)]


STARTED_WITH_LOST_OR_DEAD_SQL = """
SELECT a.id,
       bool_or(e.status = ANY(%(dead_evals)s) OR b.status = ANY(%(dead_builds)s)) AS dead,
       bool_or(d.id IS NULL OR w.channel_name IS NULL OR w.last_seen_at < %(silent)s) AS lost
FROM cluster_attempt a
JOIN cluster_member m ON m.cluster_job_id = a.cluster_job_id
LEFT JOIN evaluation e ON e.id = m.evaluation_id
LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
LEFT JOIN dispatched_job d ON d.cluster_attempt_id = a.id AND d.finished_at IS NULL
    AND d.job_id = CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
                        ELSE 'build:' || m.derivation_build_id::text END
LEFT JOIN worker w ON w.id = d.worker_id
WHERE a.finished_at IS NULL AND a.started_at IS NOT NULL
GROUP BY a.id
"""


def resolve_orphaned_attempts(now=None) -> list:
    """Started attempts whose members are gone resolve: a member job aborted or finished
    outside the attempt aborts it; a member whose worker went silent fails it, with a retry
    when the budget allows."""
    from gradient.jobs.models import BUILD_TERMINAL, EVALUATION_TERMINAL

    now = now or timezone.now()
    silent = now - timedelta(seconds=settings.GRADIENT["WORKER_TIMEOUT_SECS"])
    with connection.cursor() as cursor:
        cursor.execute(
            STARTED_WITH_LOST_OR_DEAD_SQL,
            {
                "dead_evals": sorted(EVALUATION_TERMINAL),
                "dead_builds": sorted(BUILD_TERMINAL),
                "silent": silent,
            },
        )
        rows = cursor.fetchall()
    resolved = []
    for attempt_id, dead, lost in rows:
        if dead:
            outcome = resolve_cluster_attempt(
                attempt_id, AttemptOutcome.ABORTED, retry=False, finished=ClusterStatus.ABORTED
            )
        elif lost:
            outcome = resolve_cluster_attempt(
                attempt_id, AttemptOutcome.FAILED, retry=True, finished=ClusterStatus.FAILED
            )
        else:
            continue
        if outcome is not None:
            resolved.append(attempt_id)
    return resolved


def settle_running_without_attempt() -> list:
    """A Running cluster always has a started, open attempt; one without it (a crash between
    processes' steps) ends Aborted with a dead member, Failed with a spent budget, else
    goes back to Queued."""
    open_attempt = ClusterAttempt.objects.filter(
        cluster_job=OuterRef("pk"), finished_at__isnull=True
    )
    stranded = ClusterJob.objects.filter(
        ~Exists(open_attempt), status=ClusterStatus.RUNNING
    ).values_list("pk", flat=True)
    settled = []
    for cluster_id in stranded:
        with transaction.atomic(durable=True):
            bound_lock_waits()
            if ClusterAttempt.objects.filter(
                cluster_job_id=cluster_id, finished_at__isnull=True
            ).exists():
                continue
            if dead_member_count(cluster_id):
                status = ClusterStatus.ABORTED
            elif can_retry(cluster_id):
                status = ClusterStatus.QUEUED
            else:
                status = ClusterStatus.FAILED
            if set_cluster_status(cluster_id, status, timezone.now(), only_from={"Running"}):
                settled.append(cluster_id)
    return settled


def recover(now=None) -> dict:
    """Every sweep, in the order that lets each see the previous one's result."""
    result = {
        "expired": expire_overdue_prepares(now),
        "resolved": resolve_orphaned_attempts(now),
        "settled": settle_running_without_attempt(),
    }
    if any(result.values()):
        log.info("cluster recovery: %s", {k: len(v) for k, v in result.items()})
    return result
