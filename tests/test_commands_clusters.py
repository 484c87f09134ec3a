"""The operator commands for clusters: submit_cluster, and show_cluster's history of attempts
and seats."""

from datetime import timedelta

import pytest
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchedOutcome,
    Evaluation,
)
from tests.commands import run
from tests.factories import ProjectFactory, WorkerFactory

pytestmark = pytest.mark.django_db


# submit_cluster and show_cluster


def test_a_submitted_cluster_shows_as_submitted():
    ProjectFactory(name="web")
    WorkerFactory(name="gpu-1")

    submitted = run(
        "submit_cluster",
        "--project=web",
        "--same-zone",
        "--retry-budget=2",
        "--member=server:eval:primary:pin=gpu-1",
        "--member=client:build:arch=aarch64-linux:features=kvm:paths=/a+/b",
        "--member=client:build",
    )
    shown = run("show_cluster", str(submitted["cluster"]))

    roles = [m["role"] for m in submitted["members"]]
    job_ids = [m["job_id"] for m in submitted["members"]]
    assert roles == ["server", "client", "client"]
    assert [j.split(":")[0] for j in job_ids] == ["eval", "build", "build"]
    assert shown == {
        "id": submitted["cluster"],
        "status": "Queued",
        "same_zone": True,
        "attempts": 0,
        "retry_budget": 2,
        "members": [
            {"role": "client", "job_id": job_ids[1], "primary": False, "pin": None},
            {"role": "client", "job_id": job_ids[2], "primary": False, "pin": None},
            {"role": "server", "job_id": job_ids[0], "primary": True, "pin": "gpu-1"},
        ],
        "history": [],
    }
    build = DerivationBuild.objects.get(pk=job_ids[1].split(":")[1])
    assert (build.status, build.architecture, build.required_features, build.paths) == (
        BuildStatus.QUEUED,
        "aarch64-linux",
        ["kvm"],
        ["/a", "/b"],
    )


def test_a_cluster_submitted_without_options_is_neither_same_zone_nor_retried():
    ProjectFactory(name="web")

    cluster = run("submit_cluster", "--project", "web", "--member", "solo:eval")["cluster"]

    shown = run("show_cluster", str(cluster))
    assert (shown["same_zone"], shown["retry_budget"], shown["status"]) == (False, 0, "Queued")
    assert not Evaluation.objects.get().prioritized


def test_submit_cluster_prioritized_marks_every_member_job():
    ProjectFactory(name="web")

    run("submit_cluster", "--project=web", "--prioritized", "--member=a:eval", "--member=b:build")

    assert Evaluation.objects.get().prioritized
    assert DerivationBuild.objects.get().prioritized


def test_show_cluster_gives_the_history_oldest_first_with_each_seat():
    ProjectFactory(name="web")
    w1, w2 = WorkerFactory(name="w1"), WorkerFactory(name="w2")
    submitted = run(
        "submit_cluster", "--project=web", "--member=node:eval", "--member=node:build:primary"
    )
    cluster = ClusterJob.objects.get(pk=submitted["cluster"])
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.RUNNING, attempts=2)
    (eval_key, build_key) = [m["job_id"] for m in submitted["members"]]
    t0 = timezone.now().replace(microsecond=0) - timedelta(hours=1)
    # Written newest first, so only created_at can put them in order.
    newest = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0 + timedelta(minutes=10),
        started_at=t0 + timedelta(minutes=11),
    )
    oldest = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0,
        started_at=t0 + timedelta(minutes=1),
        finished_at=t0 + timedelta(minutes=5),
        outcome=AttemptOutcome.FAILED,
    )

    def seat(attempt, key, worker, outcome=None) -> str:
        return str(
            DispatchedJob.objects.create(
                kind=key.split(":")[0],
                job_id=key,
                worker=worker,
                project=cluster.project,
                dispatched_at=attempt.created_at,
                finished_at=attempt.finished_at,
                outcome=outcome,
                cluster_attempt=attempt,
            ).pk
        )

    failed = seat(oldest, build_key, w2, DispatchedOutcome.FAILED)
    abandoned = seat(oldest, eval_key, w1, DispatchedOutcome.ABANDONED)
    running = seat(newest, eval_key, w2)
    completed = seat(newest, build_key, w1, DispatchedOutcome.COMPLETED)

    shown = run("show_cluster", str(cluster.pk))

    assert (shown["status"], shown["attempts"]) == ("Running", 2)
    assert shown["history"] == [
        {
            "id": str(oldest.pk),
            "outcome": "Failed",
            "created_at": t0.isoformat().replace("+00:00", "Z"),
            "started_at": (t0 + timedelta(minutes=1)).isoformat().replace("+00:00", "Z"),
            "finished_at": (t0 + timedelta(minutes=5)).isoformat().replace("+00:00", "Z"),
            "seats": [
                {
                    "role": "node",
                    "index": 0,
                    "job_id": eval_key,
                    "worker": "w1",
                    "outcome": "Abandoned",
                    "assignment_id": abandoned,
                },
                {
                    "role": "node",
                    "index": 1,
                    "job_id": build_key,
                    "worker": "w2",
                    "outcome": "Failed",
                    "assignment_id": failed,
                },
            ],
        },
        {
            "id": str(newest.pk),
            "outcome": None,
            "created_at": (t0 + timedelta(minutes=10)).isoformat().replace("+00:00", "Z"),
            "started_at": (t0 + timedelta(minutes=11)).isoformat().replace("+00:00", "Z"),
            "finished_at": None,
            "seats": [
                {
                    "role": "node",
                    "index": 0,
                    "job_id": eval_key,
                    "worker": "w2",
                    "outcome": None,
                    "assignment_id": running,
                },
                {
                    "role": "node",
                    "index": 1,
                    "job_id": build_key,
                    "worker": "w1",
                    "outcome": "Completed",
                    "assignment_id": completed,
                },
            ],
        },
    ]
