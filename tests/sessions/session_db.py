"""The database as a /proto session test reads it: a query off the event loop, and the rows a
refused frame must leave as they were."""

from asgiref.sync import sync_to_async

from gradient.jobs.models import DerivationBuild, DispatchedJob
from workers.models import IdleSlot, JobScore, Worker


def q(fn):
    return sync_to_async(fn)()


def snapshot():
    """Everything a refused frame must leave as it was."""
    return (
        list(DispatchedJob.objects.values_list("id", "finished_at", "outcome").order_by("id")),
        list(IdleSlot.objects.values_list("worker_id", "kind", "recorded_at").order_by("id")),
        list(
            JobScore.objects.values_list("worker_id", "job_id", "missing_nar_size").order_by(
                "worker_id", "job_id"
            )
        ),
        list(DerivationBuild.objects.values_list("id", "status").order_by("id")),
        list(
            Worker.objects.values_list("name", "zone", "draining", "architectures").order_by("id")
        ),
    )
