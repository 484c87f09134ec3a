"""The existing jobs that clusters group: projects, evaluations, shared builds, assignments.
This app knows nothing of clusters or of workers' sessions; other apps point at it."""

import uuid

from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q, Value

from gradient.jobs.states import StateMachine
from gradient.jobs.work import MAX_TIMEOUT_SECS, WorkError, check_work
from gradient.wire.keys import job_key


class Project(models.Model):
    name = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "project"
        ordering = ["name"]

    def __str__(self):
        return self.name


class EvaluationStatus(models.TextChoices):
    QUEUED = "Queued"
    FETCHING = "Fetching"
    EVALUATING_FLAKE = "EvaluatingFlake"
    EVALUATING_DERIVATION = "EvaluatingDerivation"
    BUILDING = "Building"
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABORTED = "Aborted"


E = EvaluationStatus
EVALUATION_TERMINAL = frozenset({E.COMPLETED, E.FAILED, E.ABORTED})
# An evaluation can be claimed while it is not finished (the claim's start condition).
EVALUATION_STARTABLE = frozenset(set(E) - EVALUATION_TERMINAL)
EVALUATION_MACHINE = StateMachine(
    "evaluation",
    "evaluation",
    frozenset(E),
    {
        # Back to Queued: a cluster's Retry, or a single evaluation's assignment released.
        E.QUEUED: frozenset({E.FETCHING, E.EVALUATING_FLAKE, E.EVALUATING_DERIVATION}),
        E.FETCHING: frozenset({E.QUEUED}),
        E.EVALUATING_FLAKE: frozenset({E.QUEUED, E.FETCHING}),
        E.EVALUATING_DERIVATION: frozenset({E.EVALUATING_FLAKE}),
        E.BUILDING: frozenset({E.EVALUATING_DERIVATION}),
        E.COMPLETED: frozenset({E.EVALUATING_FLAKE, E.EVALUATING_DERIVATION, E.BUILDING}),
        E.FAILED: EVALUATION_STARTABLE,
        E.ABORTED: EVALUATION_STARTABLE,
    },
)


class BuildStatus(models.TextChoices):
    CREATED = "Created"
    QUEUED = "Queued"
    BUILDING = "Building"
    COMPLETED = "Completed"
    FAILED_PERMANENT = "FailedPermanent"
    ABORTED = "Aborted"
    DEPENDENCY_FAILED = "DependencyFailed"
    SUBSTITUTED = "Substituted"
    FAILED_TRANSIENT = "FailedTransient"
    FAILED_TIMEOUT = "FailedTimeout"


B = BuildStatus
BUILD_TERMINAL = frozenset(
    {B.COMPLETED, B.FAILED_PERMANENT, B.ABORTED, B.DEPENDENCY_FAILED, B.SUBSTITUTED}
)
# Failures that send a build back to Queued; a spent budget turns them permanent.
BUILD_REQUEUEABLE = frozenset({B.FAILED_TRANSIENT, B.FAILED_TIMEOUT})
# A build can be claimed while Queued, in the substitute mode the claimer saw.
BUILD_STARTABLE = frozenset({B.QUEUED})
BUILD_MACHINE = StateMachine(
    "build",
    "derivation_build",
    frozenset(B),
    {
        # From Building: an assignment released before its build ran (prepare failed, retry).
        B.QUEUED: frozenset({B.CREATED, B.BUILDING}) | BUILD_REQUEUEABLE,
        # The Assigned transition: a claimed build is on a worker.
        B.BUILDING: BUILD_STARTABLE,
        B.COMPLETED: frozenset({B.BUILDING}),
        B.SUBSTITUTED: frozenset({B.QUEUED, B.BUILDING}),
        B.FAILED_TRANSIENT: frozenset({B.BUILDING}),
        B.FAILED_TIMEOUT: frozenset({B.BUILDING}),
        B.FAILED_PERMANENT: frozenset({B.BUILDING}) | BUILD_REQUEUEABLE,
        B.DEPENDENCY_FAILED: frozenset({B.CREATED, B.QUEUED}),
        B.ABORTED: frozenset({B.CREATED, B.QUEUED, B.BUILDING}) | BUILD_REQUEUEABLE,
    },
)


# Always true, and stated only by the head's walk over every project, so that a walk of one
# project cannot pick the index over every project and wade through the others' jobs.
EVERY_PROJECT = Q(created_at__isnull=False)


class JobFields(models.Model):
    """What a worker needs to know to take a job, shared by both kinds."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey(Project, on_delete=models.DO_NOTHING, related_name="+")
    architecture = models.CharField(max_length=64, default="x86_64-linux")
    required_features = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    # Store paths the job needs; workers score how much of them they must fetch.
    paths = ArrayField(models.TextField(), default=list, blank=True)
    prioritized = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # A member of a Queued or Running cluster, kept by clusters.models' triggers.
    active_member = models.BooleanField(default=False, db_default=False, editable=False)
    # Times a younger single job of its kind was given out while this one was first in line:
    # at GRADIENT_OFFER_WINDOW it goes before any cheaper one (protocol.md, the head).
    passed_over = models.PositiveSmallIntegerField(default=0, db_default=0, editable=False)
    # What the job runs (gradient.jobs.work): read by the claims, never by the head's walks.
    command = models.JSONField(null=True, blank=True)
    env = models.JSONField(default=dict, db_default=Value({}, models.JSONField()), blank=True)
    timeout_secs = models.IntegerField(null=True, blank=True)

    class Meta:
        abstract = True

    def clean(self):
        super().clean()
        try:
            check_work(self.command, self.env, self.timeout_secs)
        except WorkError as e:
            raise ValidationError({e.field: str(e)}) from None


def timeout_range(table: str) -> models.CheckConstraint:
    """timeout_secs null or 1 to MAX_TIMEOUT_SECS, held by PostgreSQL too, at no cost."""
    return models.CheckConstraint(
        condition=Q(timeout_secs__isnull=True)
        | Q(timeout_secs__gte=1, timeout_secs__lte=MAX_TIMEOUT_SECS),
        name=f"{table}-timeout_secs",
    )


class Evaluation(JobFields):
    status = models.CharField(
        max_length=32, choices=EvaluationStatus.choices, default=EvaluationStatus.QUEUED
    )

    class Meta:
        db_table = "evaluation"
        constraints = [timeout_range("evaluation")]
        indexes = [
            # The head of the queue (workers.head): the single evaluations that can start, in
            # the single path's order; members and finished ones are left out, so the walk
            # goes no further than the jobs a worker could take.
            models.Index(
                fields=["architecture", "-prioritized", "created_at"],
                name="idx-evaluation-head",
                condition=Q(status__in=[E.QUEUED, E.FETCHING], active_member=False) & EVERY_PROJECT,
            ),
            models.Index(
                fields=["project", "architecture", "-prioritized", "created_at"],
                name="idx-evaluation-head-proj",
                condition=Q(status__in=[E.QUEUED, E.FETCHING], active_member=False),
            ),
        ]

    def __str__(self):
        return self.job_key

    @property
    def job_key(self) -> str:
        return job_key(JobKind.EVAL, self.id)


class DerivationBuild(JobFields):
    """The shared build: one derivation built once for every evaluation that needs it."""

    status = models.CharField(
        max_length=32, choices=BuildStatus.choices, default=BuildStatus.CREATED
    )
    # Substitute mode: the output can be fetched from a cache instead of built.
    cache_available = models.BooleanField(default=False)

    class Meta:
        db_table = "derivation_build"
        constraints = [timeout_range("derivation_build")]
        indexes = [
            # The head of the queue, as for evaluations.
            models.Index(
                fields=["architecture", "-prioritized", "created_at"],
                name="idx-derivation_build-head",
                condition=Q(status=B.QUEUED, active_member=False) & EVERY_PROJECT,
            ),
            models.Index(
                fields=["project", "architecture", "-prioritized", "created_at"],
                name="idx-derivation_build-head-proj",
                condition=Q(status=B.QUEUED, active_member=False),
            ),
        ]

    def __str__(self):
        return self.job_key

    @property
    def job_key(self) -> str:
        return job_key(JobKind.BUILD, self.id)


class JobKind(models.TextChoices):
    EVAL = "eval"
    BUILD = "build"


JOB_MACHINES = {JobKind.BUILD: BUILD_MACHINE, JobKind.EVAL: EVALUATION_MACHINE}


class DispatchedOutcome(models.TextChoices):
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABANDONED = "Abandoned"


# An assignment is Open while finished_at is NULL, then finished with its outcome, for good:
# a report, a rejection, a disconnect or its attempt's close ends only an open row.
DISPATCHED_OPEN = "Open"
DISPATCHED_MACHINE = StateMachine(
    "dispatched job",
    "dispatched_job",
    frozenset({DISPATCHED_OPEN, *DispatchedOutcome}),
    {outcome: frozenset({DISPATCHED_OPEN}) for outcome in DispatchedOutcome},
    state=f"CASE WHEN {{t}}.finished_at IS NULL THEN '{DISPATCHED_OPEN}' ELSE {{t}}.outcome END",
    write="finished_at = {at}, outcome = {to}",
)


class DispatchedJob(models.Model):
    """One assignment of a job to a worker. Open while finished_at is NULL."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=8, choices=JobKind.choices)
    # The job key, eval:<uuid> or build:<uuid>: the unit of "at most one open assignment".
    job_id = models.CharField(max_length=64)
    # Telemetry outlives its job: garbage collection of the job keeps the row, keyed by job_id.
    evaluation = models.ForeignKey(
        Evaluation, null=True, blank=True, on_delete=models.DB_SET_NULL, related_name="+"
    )
    derivation_build = models.ForeignKey(
        DerivationBuild, null=True, blank=True, on_delete=models.DB_SET_NULL, related_name="+"
    )
    worker = models.ForeignKey("workers.Worker", on_delete=models.DO_NOTHING, related_name="+")
    project = models.ForeignKey(Project, on_delete=models.DO_NOTHING, related_name="+")
    steps = ArrayField(models.CharField(max_length=32), default=list, blank=True)
    dispatched_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(
        max_length=16, choices=DispatchedOutcome.choices, null=True, blank=True
    )
    # NULL for a single assignment. Member rows outlive their attempt as plain telemetry.
    cluster_attempt = models.ForeignKey(
        "clusters.ClusterAttempt",
        null=True,
        blank=True,
        on_delete=models.DB_SET_NULL,
        related_name="dispatched_jobs",
    )
    missing_nar_size = models.BigIntegerField(null=True, blank=True)
    # A cluster member's AssignJobResponse{accepted: true}: the attempt starts on the last one.
    accepted_at = models.DateTimeField(null=True, blank=True)
    # The JobFailed kind, kept for the attempt's verdict (a member's job waits for it).
    failure_kind = models.CharField(max_length=32, null=True, blank=True)
    # A member's seat that ended its attempt, and how (clusters.blame): its worker's health.
    blame = models.CharField(max_length=32, null=True, blank=True)
    # The JobFailed's error and the end of the job's output (gradient.jobs.work).
    error = models.TextField(null=True, blank=True)
    log_tail = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "dispatched_job"
        constraints = [
            # Serves the claim's ON CONFLICT: at most one open assignment per job key.
            models.UniqueConstraint(
                fields=["job_id"],
                condition=Q(finished_at__isnull=True),
                name="idx-dispatched_job-open-job",
            ),
        ]
        indexes = [
            # Open rows of one worker: disconnects and liveness abandon them.
            models.Index(
                fields=["worker"],
                condition=Q(finished_at__isnull=True),
                name="idx-dispatched_job-open-worker",
            ),
            # A worker's recent seats, newest first (show_worker, the admin's worker page).
            models.Index(
                fields=["worker", "-dispatched_at"],
                condition=Q(cluster_attempt__isnull=False),
                name="idx-dispatched_job-seats",
            ),
            # /metrics counts the blamed seats by how they ended their attempt.
            models.Index(
                fields=["blame"], condition=Q(blame__isnull=False), name="idx-dispatched_job-blame"
            ),
            # The admin's list of assignments, newest first, a page at a time.
            models.Index(fields=["dispatched_at"], name="idx-dispatched_job-dispatched"),
        ]

    def __str__(self):
        return f"{self.job_id} on {self.worker_id}"
