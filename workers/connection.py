"""A worker's session state in PostgreSQL: who is connected where, what it can do, what it was
offered. Every function is one short transaction the consumer calls from its handlers."""

from datetime import timedelta

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from clusters.recovery import report_lost_members
from gradient.jobs.models import DispatchedJob, DispatchedOutcome
from workers.assignment import candidates, offerable
from workers.models import IdleSlot, JobScore, Worker, hash_token
from workers.protocol import JobOffer, OfferedJob, WorkerCapabilities
from workers.reports import release_single

OFFER_BATCH = 200
TOUCH_EVERY = timedelta(seconds=5)


def authenticate(token: str) -> Worker | None:
    """The worker owning this token, unless unknown or revoked. Looked up by the token's hash:
    the index compares hashes, so no secret-dependent comparison happens in Python."""
    if not token:
        return None
    return Worker.objects.filter(token_hash=hash_token(token), revoked_at__isnull=True).first()


def abandon_single_assignments(worker_id: int) -> int:
    """The worker is gone: its open single assignments end Abandoned and their jobs go back to
    the queue. Its cluster members stay open: they are lost members of their attempt, which
    decides their fate. Also drops its idle slots."""
    rows = list(
        DispatchedJob.objects.select_for_update().filter(
            worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=True
        )
    )
    now = timezone.now()
    DispatchedJob.objects.filter(pk__in=[r.pk for r in rows]).update(
        finished_at=now, outcome=DispatchedOutcome.ABANDONED
    )
    release_single(rows)
    IdleSlot.objects.filter(worker_id=worker_id).delete()
    return len(rows)


def attach(worker_id: int, channel_name: str) -> str | None:
    """Record this session as the worker's live one; returns the channel of the session it
    replaces, whose work is treated as a disconnect here and now (so the old session's own
    disconnect, seeing it is no longer the live one, does nothing)."""
    now = timezone.now()
    with transaction.atomic(durable=True):
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        previous = worker.channel_name
        if previous is not None:
            abandon_single_assignments(worker_id)
        # Offers are per connection: a reconnecting worker is offered everything again.
        JobScore.objects.filter(worker_id=worker_id).delete()
        Worker.objects.filter(pk=worker_id).update(
            channel_name=channel_name, connected_at=now, last_seen_at=now, draining=False
        )
    if previous is not None:
        report_lost_members(worker_id)
    return previous


def detach(worker_id: int, channel_name: str) -> bool:
    """The session closed. Only the live session's close counts as the worker's disconnect:
    its single jobs go back to the queue, its cluster members report as lost."""
    with transaction.atomic(durable=True):
        gone = Worker.objects.filter(pk=worker_id, channel_name=channel_name).update(
            channel_name=None
        )
        if gone:
            abandon_single_assignments(worker_id)
    if gone:
        report_lost_members(worker_id)
    return bool(gone)


def touch(worker_id: int, channel_name: str) -> bool:
    """Liveness: any frame counts. Written at most every few seconds; returns False when this
    session is no longer the worker's live one or its token was revoked."""
    now = timezone.now()
    Worker.objects.filter(
        Q(last_seen_at__isnull=True) | Q(last_seen_at__lt=now - TOUCH_EVERY),
        pk=worker_id,
        channel_name=channel_name,
    ).update(last_seen_at=now)
    return Worker.objects.filter(
        pk=worker_id, channel_name=channel_name, revoked_at__isnull=True
    ).exists()


def record_capabilities(worker_id: int, caps: WorkerCapabilities) -> str:
    Worker.objects.filter(pk=worker_id).update(
        architectures=caps.architectures,
        system_features=caps.system_features,
        max_concurrent_builds=caps.max_concurrent_builds,
        max_concurrent_evals=caps.max_concurrent_evals,
        can_eval=caps.eval,
        can_build=caps.build,
        can_fetch=caps.fetch,
        zone=caps.zone,
        endpoint=caps.endpoint,
    )
    # New capabilities may change which jobs fit: offer afresh.
    JobScore.objects.filter(worker_id=worker_id, scored_at__isnull=True).delete()
    return Worker.objects.values_list("name", flat=True).get(pk=worker_id)


def start_draining(worker_id: int) -> None:
    with transaction.atomic(durable=True):
        Worker.objects.filter(pk=worker_id).update(draining=True)
        IdleSlot.objects.filter(worker_id=worker_id).delete()


def new_offers(worker_id: int) -> JobOffer | None:
    """Jobs this worker could take that it has not been offered yet, cluster members among
    them; remembered as offered so the next call sends only newer ones."""
    from gradient.jobs.models import DerivationBuild, Evaluation, JobKind

    worker = Worker.objects.get(pk=worker_id)
    if worker.draining:
        return None
    offered = set(JobScore.objects.filter(worker_id=worker_id).values_list("job_id", flat=True))
    jobs = []
    for kind, model in ((JobKind.EVAL, Evaluation), (JobKind.BUILD, DerivationBuild)):
        how = offerable(worker, kind)
        if how is None:
            continue
        ids = [row[0] for row in candidates(worker, how, members=True, limit=OFFER_BATCH)]
        fresh = [pk for pk in ids if f"{kind}:{pk}" not in offered]
        for job in model.objects.filter(pk__in=fresh).annotate(project_name=F("project__name")):
            jobs.append(
                OfferedJob(
                    job_id=f"{kind}:{job.pk}",
                    kind=kind,
                    project=job.project_name,
                    architecture=job.architecture,
                    required_features=job.required_features,
                    paths=job.paths,
                )
            )
    if not jobs:
        return None
    now = timezone.now()
    JobScore.objects.bulk_create(
        [JobScore(worker_id=worker_id, job_id=j.job_id, offered_at=now) for j in jobs],
        ignore_conflicts=True,
    )
    return JobOffer(jobs=jobs)


def record_scores(worker_id: int, scores) -> int:
    """Store a JobScores answer; scores for jobs never offered are kept too (harmless, and a
    worker may score ahead)."""
    now = timezone.now()
    rows = [
        JobScore(
            worker_id=worker_id,
            job_id=s.job_id,
            offered_at=now,
            missing_count=s.missing_count,
            missing_nar_size=s.missing_nar_size,
            scored_at=now,
        )
        for s in scores
    ]
    JobScore.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["worker", "job_id"],
        update_fields=["missing_count", "missing_nar_size", "scored_at"],
    )
    return len(rows)
