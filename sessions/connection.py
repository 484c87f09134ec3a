"""A worker's session state in PostgreSQL: who is connected where, what it can do, what it was
offered. Every function is one short transaction the consumer calls from its handlers."""

from typing import NamedTuple

from django.db import connection as db_connection
from django.db import transaction
from django.utils import timezone

from clusters.recovery import report_lost_members
from gradient.jobs.models import DispatchedJob, DispatchedOutcome
from gradient.jobs.transitions import finish_assignments
from gradient.wire.protocol import RunningJob, WorkerCapabilities
from sessions import statements
from sessions.reports import release_single
from workers.models import IdleSlot, JobScore, Worker, hash_token


def bearer_token(headers) -> str:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def authenticate(token: str) -> tuple[int, str] | None:
    """(id, name) of the worker owning this token, unless unknown or revoked; looked up by hash, so
    nothing compares the secret in Python."""
    if not token:
        return None
    # Plain SQL: the ORM's compiling of this lookup costs more than its round trip.
    with db_connection.cursor() as cursor:
        cursor.execute(statements.AUTHENTICATE_SQL, [hash_token(token)])
        return cursor.fetchone()


def abandon_single_assignments(worker_id: int, keep=frozenset()) -> int:
    """The worker is gone: its open single assignments but those in `keep` end Abandoned, their
    jobs requeued, its idle slots dropped; its cluster members are left to their attempts."""
    rows = list(
        DispatchedJob.objects.select_for_update()
        .filter(worker_id=worker_id, finished_at__isnull=True, cluster_attempt__isnull=True)
        .exclude(pk__in=keep)
    )
    finish_assignments([r.pk for r in rows], DispatchedOutcome.ABANDONED)
    release_single(rows)
    IdleSlot.objects.filter(worker_id=worker_id).delete()
    return len(rows)


class Attached(NamedTuple):
    previous: str | None  # the channel of the session this one replaces
    # That session left open assignments: they are released by release_earlier() once the
    # worker says what it still runs, or by detach() if this session ends first.
    earlier_open: bool


def attach(worker_id: int, channel_name: str) -> Attached:
    """Record this session as the live one, so that the old one's own disconnect does nothing."""
    now = timezone.now()
    with db_connection.cursor() as cursor:
        cursor.execute(
            statements.QUIET_ATTACH_SQL, {"worker": worker_id, "channel": channel_name, "now": now}
        )
        row = cursor.fetchone()
    if row is not None:
        return Attached(row[0], False)
    with transaction.atomic(durable=True):
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        previous = worker.channel_name
        JobScore.objects.filter(worker_id=worker_id).delete()
        Worker.objects.filter(pk=worker_id).update(
            channel_name=channel_name, connected_at=now, last_seen_at=now, draining=False
        )
    return Attached(previous, previous is not None)


def release_earlier(worker_id: int, running: list[RunningJob]) -> list[RunningJob]:
    """The earlier session's open assignments the worker no longer runs are given up as at a
    disconnect; what it says it runs that is no longer open here is returned, to abort."""
    claimed = {(r.job_id, r.assignment_id) for r in running}
    with transaction.atomic(durable=True):
        rows = DispatchedJob.objects.filter(worker_id=worker_id, finished_at__isnull=True)
        kept = {r.pk for r in rows.only("pk", "job_id") if (r.job_id, str(r.pk)) in claimed}
        abandon_single_assignments(worker_id, keep=kept)
    report_lost_members(worker_id, keep=kept)
    still_open = {str(pk) for pk in kept}
    return [r for r in running if r.assignment_id not in still_open]


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
    """Liveness: False when this session is no longer the live one or its token was revoked."""
    params = {"worker": worker_id, "channel": channel_name, "now": timezone.now()}
    with db_connection.cursor() as cursor:
        cursor.execute(statements.TOUCH_SQL, params)
        return cursor.fetchone()[0]


def record_capabilities(worker_id: int, caps: WorkerCapabilities) -> Worker:
    params = {
        "worker": worker_id,
        "architectures": caps.architectures,
        "system_features": caps.system_features,
        "max_builds": caps.max_concurrent_builds,
        "max_evals": caps.max_concurrent_evals,
        "eval": caps.eval,
        "build": caps.build,
        "fetch": caps.fetch,
        "zone": caps.zone,
        "endpoint": caps.endpoint,
    }
    for worker in Worker.objects.raw(statements.CAPABILITIES_SQL, params):
        return worker
    raise Worker.DoesNotExist(worker_id)


def start_draining(worker_id: int) -> None:
    with transaction.atomic(durable=True):
        Worker.objects.filter(pk=worker_id).update(draining=True)
        IdleSlot.objects.filter(worker_id=worker_id).delete()
