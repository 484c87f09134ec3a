"""Clusters of an evaluation ("server") and a build ("client") in each stage an abort meets,
and how to read them back, for the abort tests. A dispatch pass claims the preparing and
running ones: the tests that make them commit their rows (tests.clusterflow.committed)."""

from clusters import coordinator
from clusters.dispatch import run_pass
from clusters.models import ClusterAttempt, ClusterJob
from clusters.settlement import member_report
from gradient.jobs.models import DispatchedJob
from tests.clusterflow import Inbox, idle_workers
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory
from workers.models import IdleSlot


def waiting_cluster(**fields):
    cluster = ClusterFactory(**fields)
    EvalMemberFactory(cluster_job=cluster, role="server", primary=True)
    BuildMemberFactory(cluster_job=cluster, role="client")
    return cluster


def preparing_cluster(accepted=()):
    """Claimed by the dispatch pass and held on two workers; `accepted` kinds answered yes."""
    cluster = waiting_cluster()
    IdleSlot.objects.all().delete()  # a former seat's slot of the other kind: only these two
    workers = idle_workers(2)
    inbox = Inbox(workers)
    assert run_pass().claimed == [cluster.pk]
    rows = {r.kind: r for r in DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster)}
    for kind in accepted:
        assert coordinator.accept_assignment(rows[kind].worker_id, rows[kind].job_id) is False
    drain(inbox, workers)
    return cluster, rows, inbox, workers


def running_cluster(retry_budget=0):
    cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
    ClusterJob.objects.filter(pk=cluster.pk).update(retry_budget=retry_budget)
    assert coordinator.accept_assignment(rows["build"].worker_id, rows["build"].job_id) is True
    drain(inbox, workers)
    return cluster, rows, inbox, workers


def drain(inbox, workers):
    for w in workers:
        inbox.frames(w)


def worker_of(row, workers):
    return next(w for w in workers if w.pk == row.worker_id)


def report(row, outcome, kind=None):
    return member_report(row.worker_id, row.job_id, row.pk, outcome, kind)


def statuses(cluster):
    """(cluster, evaluation, build) statuses."""
    cluster.refresh_from_db()
    evaluation = cluster.members.get(role="server").evaluation
    build = cluster.members.get(role="client").derivation_build
    evaluation.refresh_from_db()
    build.refresh_from_db()
    return cluster.status, evaluation.status, build.status


def snapshot(cluster):
    """Everything an abort could touch."""
    cluster.refresh_from_db()
    return (
        statuses(cluster),
        cluster.updated_at,
        list(
            ClusterAttempt.objects.filter(cluster_job=cluster).values_list(
                "pk", "started_at", "finished_at", "outcome"
            )
        ),
        list(
            DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster)
            .order_by("pk")
            .values_list("pk", "finished_at", "outcome")
        ),
    )
