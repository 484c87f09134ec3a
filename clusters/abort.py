"""Aborting a cluster job as an evaluation abort would (the spec's Recovery, the Abort verdict).

- An open attempt is decided Abort through settlement.abort_attempt, a member's evaluation
  abort's path: reported members settle with their own outcome, survivors end Aborted and are
  told AbortCluster (and AbortJob once started; their later JobFailed{aborted} changes nothing).
- Without an open attempt (waiting, or a stranded Running cluster), one transaction ends the
  cluster and its member jobs Aborted.

Every step re-checks under its lock, in the claim module's order, and writes nothing if the
state moved on; the abort then starts over from what is there now.
"""

import logging

from django.db import OperationalError, transaction
from django.utils import timezone

from clusters.claim import bound_lock_waits
from clusters.models import (
    CLUSTER_MACHINE,
    CLUSTER_TERMINAL,
    ClusterAttempt,
    ClusterJob,
    ClusterMember,
    ClusterStatus,
    open_attempts,
)
from clusters.settlement import abort_attempt
from gradient.jobs.models import BuildStatus, DispatchedJob, DispatchedOutcome, EvaluationStatus
from gradient.jobs.transitions import advance_builds, advance_evaluations, move
from gradient.logs import ids
from gradient.wire.groups import send_frames
from gradient.wire.protocol import AbortJob

log = logging.getLogger(__name__)

DEFAULT_REASON = "aborted by an operator"
# The reason travels in AbortCluster/AbortJob frames, which a worker caps at 1 MiB.
MAX_REASON_CHARS = 1000
# A cluster claimed and released over and over must not hold the caller forever.
MAX_TRIES = 10


class AbortRefused(Exception):
    """The cluster was not aborted, and nothing was changed."""


class UnknownCluster(AbortRefused):
    def __init__(self, cluster_id):
        super().__init__(f"unknown cluster {cluster_id}")


class AlreadyFinished(AbortRefused):
    def __init__(self, cluster_id, status: str):
        super().__init__(f"cluster {cluster_id} is already {status}")
        self.status = status


def abort_cluster(cluster_id, reason: str = DEFAULT_REASON) -> str:
    """Abort the cluster and its member jobs; its final status. Raises AbortRefused having changed
    nothing. Call it outside any transaction: frames go out after the commits that justify them."""
    if len(reason) > MAX_REASON_CHARS:
        raise AbortRefused(f"the reason is longer than {MAX_REASON_CHARS} characters")
    for _ in range(MAX_TRIES):
        status = ClusterJob.objects.filter(pk=cluster_id).values_list("status", flat=True).first()
        if status is None:
            raise UnknownCluster(cluster_id)
        if status in CLUSTER_TERMINAL:
            raise AlreadyFinished(cluster_id, status)
        attempt_id = open_attempts(cluster_id).values_list("pk", flat=True).first()
        try:
            if attempt_id is None:
                done = _abort_waiting(cluster_id)
            else:
                done = _abort_attempt(attempt_id, reason)
        except OperationalError as exc:  # lock_timeout: a rival holds the rows; rolled back
            raise AbortRefused(f"cluster {cluster_id} is busy, try again ({exc})") from exc
        if done:
            log.info("cluster %s aborted: %s", cluster_id, reason, extra=ids(cluster=cluster_id))
            return ClusterStatus.ABORTED
    raise AbortRefused(f"cluster {cluster_id} kept changing while being aborted, try again")


def _abort_attempt(attempt_id, reason: str) -> bool:
    """The Abort verdict on the open attempt; False (nothing written) if it closed meanwhile."""
    if not abort_attempt(attempt_id, reason):
        return False
    # Closed now, so whether it had started is final; survivors are the rows it abandoned.
    started = ClusterAttempt.objects.values_list("started_at", flat=True).get(pk=attempt_id)
    if started is not None:
        survivors = DispatchedJob.objects.filter(
            cluster_attempt_id=attempt_id, outcome=DispatchedOutcome.ABANDONED
        ).values_list("worker_id", "job_id")
        send_frames([(w, AbortJob(job_id=job, reason=reason)) for w, job in survivors])
    return True


def _abort_waiting(cluster_id) -> bool:
    """A cluster without an open attempt ends Aborted with its member jobs, in one
    transaction; False (nothing written) if it finished or was claimed meanwhile."""
    with transaction.atomic(durable=True):
        bound_lock_waits()
        # A claim inserts its attempt holding this row FOR SHARE: locking it waits for the
        # claim, and the check below then sees its attempt; a later claim finds it Aborted.
        status = (
            ClusterJob.objects.select_for_update()
            .filter(pk=cluster_id)
            .values_list("status", flat=True)
            .first()
        )
        if status is None or status in CLUSTER_TERMINAL:
            return False
        if open_attempts(cluster_id).exists():
            return False
        if not move(CLUSTER_MACHINE, [cluster_id], ClusterStatus.ABORTED, at=timezone.now()):
            return False
        members = ClusterMember.objects.filter(cluster_job_id=cluster_id).values_list(
            "evaluation_id", "derivation_build_id"
        )
        advance_evaluations([e for e, _ in members if e], EvaluationStatus.ABORTED)
        advance_builds([b for _, b in members if b], BuildStatus.ABORTED)
    return True
