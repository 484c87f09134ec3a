"""The spec's tables: cluster_job, cluster_member, cluster_attempt (dispatched_job lives with
the jobs it assigns and points back here through cluster_attempt)."""

import uuid
from datetime import datetime, timedelta

import pgtrigger
from django.conf import settings
from django.db import models
from django.db.models import F, Func, IntegerField, Q
from django.db.models.lookups import Exact

from gradient.jobs.models import DerivationBuild, Evaluation, JobKind, Project
from gradient.jobs.states import StateMachine
from gradient.wire.keys import member_key


class ClusterStatus(models.TextChoices):
    QUEUED = "Queued"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABORTED = "Aborted"


C = ClusterStatus
CLUSTER_ACTIVE = frozenset({C.QUEUED, C.RUNNING})
CLUSTER_TERMINAL = frozenset({C.COMPLETED, C.FAILED, C.ABORTED})
# A cluster is claimed (an attempt opened for it) only while Queued.
CLUSTER_CLAIMABLE = frozenset({C.QUEUED})
CLUSTER_MACHINE = StateMachine(
    "cluster job",
    "cluster_job",
    frozenset(C),
    {
        # The start: its attempt's last acceptance.
        C.RUNNING: CLUSTER_CLAIMABLE,
        # The verdict on its started attempt: Retry, Complete, Fail.
        C.QUEUED: frozenset({C.RUNNING}),
        C.COMPLETED: frozenset({C.RUNNING}),
        C.FAILED: frozenset({C.RUNNING}),
        # An abort: waiting, preparing or running.
        C.ABORTED: CLUSTER_ACTIVE,
    },
    write="status = {to}, updated_at = {at}",
)


class AttemptOutcome(models.TextChoices):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    PREPARE_FAILED = "PrepareFailed"
    ABORTED = "Aborted"


# An attempt is Open from its claim, Started once every member accepted (started_at), and
# finished with its outcome (finished_at), for good.
ATTEMPT_OPEN = "Open"
ATTEMPT_STARTED = "Started"
A = AttemptOutcome
ATTEMPT_MACHINE = StateMachine(
    "cluster attempt",
    "cluster_attempt",
    frozenset({ATTEMPT_OPEN, ATTEMPT_STARTED, *A}),
    {
        # The last member's acceptance.
        ATTEMPT_STARTED: frozenset({ATTEMPT_OPEN}),
        # A reject, the prepare timeout or a held member's failure: only before the start.
        A.PREPARE_FAILED: frozenset({ATTEMPT_OPEN}),
        # The verdict on a started attempt.
        A.SUCCEEDED: frozenset({ATTEMPT_STARTED}),
        A.FAILED: frozenset({ATTEMPT_STARTED}),
        # An evaluation abort reaching it, preparing or started.
        A.ABORTED: frozenset({ATTEMPT_OPEN, ATTEMPT_STARTED}),
    },
    state=(
        "CASE WHEN {t}.finished_at IS NOT NULL THEN {t}.outcome"
        f" WHEN {{t}}.started_at IS NOT NULL THEN '{ATTEMPT_STARTED}' ELSE '{ATTEMPT_OPEN}' END"
    ),
    write="finished_at = {at}, outcome = {to}",
    writes={ATTEMPT_STARTED: "started_at = {at}"},
)

# An attempt is open until it finishes; idx-cluster_attempt-open keeps one at most per cluster.
# The same rule in the ORM (over ClusterAttempt) and in SQL (over an attempt aliased a).
ATTEMPT_IS_OPEN = Q(finished_at__isnull=True)
ATTEMPT_IS_OPEN_SQL = "a.finished_at IS NULL"


def open_attempts(cluster):
    """The cluster's open attempt, a queryset of one row at most; `cluster` an id or OuterRef."""
    return ClusterAttempt.objects.filter(cluster_job=cluster).filter(ATTEMPT_IS_OPEN)


# A cluster whose prepare failed backs off before it is placed again: in the ORM and in SQL
# (over an attempt aliased a, the cutoff bound to %(backoff)s), both from backoff_since.
def retry_backoff() -> timedelta:
    return timedelta(seconds=settings.GRADIENT["CLUSTER_RETRY_BACKOFF_SECS"])


def backoff_since(now: datetime) -> datetime:
    """A cluster whose prepare failed after this still backs off."""
    return now - retry_backoff()


def backing_off(now: datetime) -> Q:
    return Q(outcome=AttemptOutcome.PREPARE_FAILED, finished_at__gt=backoff_since(now))


BACKING_OFF_SQL = f"a.outcome = '{AttemptOutcome.PREPARE_FAILED}' AND a.finished_at > %(backoff)s"


def no_open_attempt_sql(cluster: str) -> str:
    """SQL: the cluster whose id is the SQL `cluster` has no open attempt."""
    return (
        "NOT EXISTS (SELECT 1 FROM cluster_attempt a\n"
        f"            WHERE a.cluster_job_id = {cluster} AND {ATTEMPT_IS_OPEN_SQL})"
    )


# The job rows' active_member follows their cluster (true while Queued or Running), whoever
# writes cluster_job or cluster_member, through set_active_member (clusters migration 0005).
_ACTIVE = "(" + ", ".join(f"'{s}'" for s in sorted(CLUSTER_ACTIVE)) + ")"
CLUSTER_JOB_ACTIVE = pgtrigger.Trigger(
    name="cluster_job_active",
    when=pgtrigger.After,
    operation=pgtrigger.UpdateOf("status"),
    condition=pgtrigger.Condition(
        f"((OLD.status IN {_ACTIVE}) IS DISTINCT FROM (NEW.status IN {_ACTIVE}))"
    ),
    func=(
        "PERFORM set_active_member(m.evaluation_id, m.derivation_build_id,"
        f" NEW.status IN {_ACTIVE}) FROM cluster_member m WHERE m.cluster_job_id = NEW.id;"
        " RETURN NULL;"
    ),
)
CLUSTER_MEMBER_ACTIVE = pgtrigger.Trigger(
    name="cluster_member_active",
    when=pgtrigger.After,
    operation=(
        pgtrigger.Insert
        | pgtrigger.Delete
        | pgtrigger.UpdateOf("cluster_job_id", "evaluation_id", "derivation_build_id")
    ),
    func=(
        "IF TG_OP IN ('UPDATE', 'DELETE') THEN"
        " PERFORM set_active_member(OLD.evaluation_id, OLD.derivation_build_id, false);"
        " END IF; IF TG_OP IN ('INSERT', 'UPDATE') THEN"
        " PERFORM set_active_member(NEW.evaluation_id, NEW.derivation_build_id,"
        " EXISTS (SELECT 1 FROM cluster_job c"
        f" WHERE c.id = NEW.cluster_job_id AND c.status IN {_ACTIVE}));"
        " END IF; RETURN NULL;"
    ),
)


class ClusterJob(models.Model):
    project = models.ForeignKey(Project, on_delete=models.DO_NOTHING, related_name="+")
    status = models.CharField(
        max_length=16, choices=ClusterStatus.choices, default=ClusterStatus.QUEUED
    )
    same_zone = models.BooleanField(default=False)
    # Started attempts; a failed prepare does not count.
    attempts = models.PositiveIntegerField(default=0)
    # How many retries after a failed started attempt (not the per-evaluation budget).
    retry_budget = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # The aging reservation's clock: since when the pass has seen the cluster able to start and
    # unplaced (clusters.reservation.note_waiting); NULL otherwise.
    waiting_since = models.DateTimeField(null=True, blank=True, editable=False)
    # Placed before other clusters: set at submission when any member job is prioritized.
    prioritized = models.BooleanField(default=False, db_default=False)
    # When the pass last asked the idle workers that could seat its members for their scores
    # (clusters.asking).
    offered_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Its status and attempts are counted in cluster_metric_tally (gradient.metrics.fold).
    tallied = models.BooleanField(default=False, db_default=False, editable=False)

    class Meta:
        db_table = "cluster_job"
        triggers = [CLUSTER_JOB_ACTIVE]
        indexes = [
            # The cluster book (clusters.book) selects Queued clusters, oldest first.
            models.Index(fields=["status", "created_at"], name="idx-cluster_job-status"),
            # The members' part of the head of the queue walks the waiting clusters in the
            # planner's order (per project for a worker limited to some); the pass clears the
            # clocks of clusters no longer waiting, few rows, found here too.
            models.Index(
                fields=["-prioritized", "created_at", "id"],
                condition=Q(waiting_since__isnull=False),
                name="idx-cluster_job-waiting",
            ),
            models.Index(
                fields=["project", "-prioritized", "created_at", "id"],
                condition=Q(waiting_since__isnull=False),
                name="idx-cluster_job-waiting-proj",
            ),
            # /metrics counts the untallied clusters and folds the finished ones among them.
            models.Index(
                fields=["id"], condition=Q(tallied=False), name="idx-cluster_job-untallied"
            ),
        ]

    def __str__(self):
        return f"cluster {self.pk}"


class NumNonNulls(Func):
    function = "num_nonnulls"
    output_field = IntegerField()


class ClusterMember(models.Model):
    # Evaluation garbage collection (or retention) deletes members with their job or cluster.
    cluster_job = models.ForeignKey(ClusterJob, on_delete=models.DB_CASCADE, related_name="members")
    # Indexed by the unique partial indexes below alone: a member's job is never NULL where
    # it is looked up, and a full index would also hold the other kind's NULLs.
    evaluation = models.ForeignKey(
        Evaluation,
        null=True,
        blank=True,
        on_delete=models.DB_CASCADE,
        related_name="+",
        db_index=False,
    )
    derivation_build = models.ForeignKey(
        DerivationBuild,
        null=True,
        blank=True,
        on_delete=models.DB_CASCADE,
        related_name="+",
        db_index=False,
    )
    role = models.CharField(max_length=100)
    primary = models.BooleanField(default=False)
    # Worker name the member must sit on, if any.
    pin = models.CharField(max_length=200, null=True, blank=True)

    class Meta:
        db_table = "cluster_member"
        triggers = [CLUSTER_MEMBER_ACTIVE]
        ordering = ["cluster_job_id", "role", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Exact(NumNonNulls(F("evaluation"), F("derivation_build")), 1),
                name="cluster_member-one-job",
            ),
            # At most one cluster per job.
            models.UniqueConstraint(
                fields=["evaluation"],
                condition=Q(evaluation__isnull=False),
                name="idx-cluster_member-evaluation",
            ),
            models.UniqueConstraint(
                fields=["derivation_build"],
                condition=Q(derivation_build__isnull=False),
                name="idx-cluster_member-derivation_build",
            ),
        ]
        indexes = [
            # A pinned member is offered to its pin's worker whatever its place in the head.
            models.Index(
                fields=["pin"], condition=Q(pin__isnull=False), name="idx-cluster_member-pin"
            ),
        ]

    def __str__(self):
        return f"{self.role} of cluster {self.cluster_job_id}"

    @property
    def kind(self) -> str:
        return JobKind.EVAL if self.evaluation_id else JobKind.BUILD

    @property
    def job_key(self) -> str:
        return member_key(self.evaluation_id, self.derivation_build_id)


class ClusterAttempt(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    cluster_job = models.ForeignKey(
        ClusterJob, on_delete=models.DB_CASCADE, related_name="attempts_made"
    )
    created_at = models.DateTimeField()
    # Unset until every member accepted.
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=AttemptOutcome.choices, null=True, blank=True)

    class Meta:
        db_table = "cluster_attempt"
        ordering = ["created_at"]
        constraints = [
            # Serves claim_cluster's ON CONFLICT: at most one open attempt per cluster.
            models.UniqueConstraint(
                fields=["cluster_job"],
                condition=ATTEMPT_IS_OPEN,
                name="idx-cluster_attempt-open",
            ),
        ]
        indexes = [
            # The admin's list of attempts, newest first, a page at a time.
            models.Index(fields=["created_at"], name="idx-cluster_attempt-created"),
        ]

    def __str__(self):
        return f"attempt {self.id}"


class ClusterReservation(models.Model):
    """An aging reservation: a cluster that waited too long holds a placement over busy
    workers until every seat is idle. At most one is active (released_at NULL) at a time."""

    cluster_job = models.ForeignKey(
        ClusterJob, on_delete=models.DB_CASCADE, related_name="reservations"
    )
    # Constant 1: with the partial unique index below, allows one active reservation only.
    singleton = models.PositiveSmallIntegerField(default=1, editable=False)
    created_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    release_reason = models.CharField(max_length=100, null=True, blank=True)

    class Meta:
        db_table = "cluster_reservation"
        constraints = [
            models.UniqueConstraint(
                fields=["singleton"],
                condition=Q(released_at__isnull=True),
                name="idx-cluster_reservation-one-active",
            ),
        ]

    def __str__(self):
        return f"reservation of cluster {self.cluster_job_id}"


class ReservationSeat(models.Model):
    """One reserved seat: this worker gets no new single job of this kind while reserved."""

    reservation = models.ForeignKey(
        ClusterReservation, on_delete=models.DB_CASCADE, related_name="seats"
    )
    worker = models.ForeignKey("workers.Worker", on_delete=models.DB_CASCADE, related_name="+")
    kind = models.CharField(max_length=8)
    job_id = models.CharField(max_length=64)

    class Meta:
        db_table = "reservation_seat"
        constraints = [
            models.UniqueConstraint(
                fields=["reservation", "worker"], name="idx-reservation_seat-worker"
            ),
        ]

    def __str__(self):
        return f"{self.job_id} on worker {self.worker_id}"


class MetricTally(models.Model):
    """What /metrics no longer reads from the rows: the tallied clusters by status and their
    attempts' figures (gradient.metrics), so that no counter goes down when retention deletes."""

    metric = models.CharField(max_length=64)
    # A counter's label value, or a histogram's "label|le" bucket and "label|sum".
    series = models.CharField(max_length=64)
    value = models.FloatField(default=0)

    class Meta:
        db_table = "cluster_metric_tally"
        constraints = [
            models.UniqueConstraint(fields=["metric", "series"], name="idx-metric_tally-series"),
        ]

    def __str__(self):
        return f"{self.metric}{{{self.series}}} {self.value}"
