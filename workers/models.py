"""Workers: identity (a token hash), project access, capabilities and connection state."""

import hashlib
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models

from gradient.jobs.models import Project

TOKEN_BYTES = 32


def hash_token(token: str) -> str:
    # Tokens are 256 random bits, so a plain SHA-256 is as strong as a slow hash here.
    return hashlib.sha256(token.encode()).hexdigest()


class Worker(models.Model):
    name = models.CharField(max_length=200, unique=True)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Project access: every project, or only those listed.
    all_projects = models.BooleanField(default=True)
    projects = models.ManyToManyField(Project, blank=True, related_name="+")

    # Capabilities, as last reported in WorkerCapabilities.
    architectures = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    system_features = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    max_concurrent_builds = models.PositiveIntegerField(default=0)
    max_concurrent_evals = models.PositiveIntegerField(default=0)
    can_eval = models.BooleanField(default=False)
    can_build = models.BooleanField(default=False)
    can_fetch = models.BooleanField(default=False)
    zone = models.CharField(max_length=200, null=True, blank=True)
    endpoint = models.CharField(max_length=500, null=True, blank=True)
    # Sent Draining: takes no new job and records no idle slot until it reconnects.
    draining = models.BooleanField(default=False)

    # Connection state: set by the live session, cleared on disconnect.
    channel_name = models.CharField(max_length=200, null=True, blank=True, editable=False)
    connected_at = models.DateTimeField(null=True, blank=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    # Health (protocol.md, "Worker health"; workers.health): blamed seats since its last seat
    # that succeeded, and the latest quarantine, in force while quarantined_until is ahead.
    blamed_in_row = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    quarantined_since = models.DateTimeField(null=True, blank=True, editable=False)
    quarantined_until = models.DateTimeField(null=True, blank=True, editable=False)
    quarantine_reason = models.CharField(max_length=500, null=True, blank=True, editable=False)
    quarantined_by = models.CharField(max_length=16, null=True, blank=True, editable=False)

    class Meta:
        db_table = "worker"
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def connected(self) -> bool:
        return self.channel_name is not None

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(TOKEN_BYTES)

    def may_access(self, project_id: int) -> bool:
        return self.all_projects or self.projects.filter(pk=project_id).exists()


class IdleSlot(models.Model):
    """An empty answer to RequestJob: the worker has a free slot of this kind. The planner's
    only view of free capacity; it trusts a slot while fresh (idle_slot_fresh_since)."""

    worker = models.ForeignKey(
        Worker,
        on_delete=models.DB_CASCADE,
        related_name="idle_slots",
        db_index=False,  # idx-idle_slot-worker-kind leads with the worker
    )
    kind = models.CharField(max_length=8)
    recorded_at = models.DateTimeField()

    class Meta:
        db_table = "idle_slot"
        constraints = [
            models.UniqueConstraint(fields=["worker", "kind"], name="idx-idle_slot-worker-kind"),
        ]
        indexes = [models.Index(fields=["kind", "recorded_at"], name="idx-idle_slot-fresh")]

    def __str__(self):
        return f"{self.worker_id}/{self.kind}"


def idle_slot_fresh_since(now: datetime) -> datetime:
    """The idle slot's still-fresh cutoff: a slot recorded at or after it is live."""
    return now - timedelta(seconds=settings.GRADIENT["IDLE_SLOT_TTL_SECS"])


class JobScore(models.Model):
    """A worker's answer for a job it was offered: what it would have to fetch. A pair never
    scored has no row and counts as the most expensive seat."""

    # The pair is the key: no id, sequence or index of its own to write for each row.
    pk = models.CompositePrimaryKey("worker", "job_id")
    worker = models.ForeignKey(
        Worker,
        on_delete=models.DB_CASCADE,
        related_name="+",
        db_index=False,  # the key's own index leads with the worker
    )
    job_id = models.CharField(max_length=64)
    offered_at = models.DateTimeField()
    missing_count = models.BigIntegerField(null=True)
    missing_nar_size = models.BigIntegerField(null=True)
    scored_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "job_score"
        indexes = [
            # The dispatch pass reads each member job's cheapest answered scores in order,
            # from the index alone; the pruning pass finds a job's rows by key.
            models.Index(
                fields=["job_id", "missing_nar_size", "worker"],
                name="idx-job_score-job-size",
            )
        ]

    def __str__(self):
        return f"{self.job_id} on {self.worker_id}"
