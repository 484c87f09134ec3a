"""The admin's lists: filters, searches, columns from annotations, and a bounded number of
queries however many rows they show."""

from datetime import timedelta

import pytest
from django.contrib.admin import site
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob, DispatchedOutcome, JobKind
from tests.admin_rows import CLUSTERS, attempt, dispatched, listed, seat, two_attempts
from tests.factories import (
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    ProjectFactory,
    WorkerFactory,
)
from workers.admin import WorkerAdmin
from workers.models import IdleSlot, Worker

pytestmark = pytest.mark.django_db


def test_the_cluster_list_filters_by_status(admin_client):
    queued = ClusterFactory(status=ClusterStatus.QUEUED)
    ClusterFactory(status=ClusterStatus.RUNNING)
    assert listed(admin_client, CLUSTERS, status__exact="Queued") == {queued}


def test_the_cluster_list_filters_by_same_zone(admin_client):
    zoned = ClusterFactory(same_zone=True)
    ClusterFactory(same_zone=False)
    assert listed(admin_client, CLUSTERS, same_zone__exact="1") == {zoned}


def test_a_search_by_role_finds_the_cluster_and_keeps_its_member_count(admin_client):
    cluster = EvalMemberFactory(role="server-a").cluster_job
    EvalMemberFactory(cluster_job=cluster, role="server-b")
    EvalMemberFactory(role="client")
    [found] = listed(admin_client, CLUSTERS, q="server")
    assert found == cluster
    # Both members match the search join; the count must not double.
    assert found.num_members == 2


def test_a_search_by_id_finds_only_that_cluster(admin_client):
    cluster, _ = ClusterFactory(), ClusterFactory()
    assert listed(admin_client, CLUSTERS, q=str(cluster.pk)) == {cluster}


def test_the_dispatched_job_list_filters_by_outcome_and_searches_by_job_id(admin_client):
    worker = WorkerFactory()
    row = dispatched(worker)
    url = reverse("admin:jobs_dispatchedjob_changelist")
    assert listed(admin_client, url, outcome__isnull="True") == {row}
    assert listed(admin_client, url, outcome__exact="Failed") == set()
    assert listed(admin_client, url, q=row.job_id.removeprefix("eval:")) == {row}


def make_clusters(n):
    for i in range(n):
        member = EvalMemberFactory(cluster_job=ClusterFactory(project=ProjectFactory()))
        BuildMemberFactory(cluster_job=member.cluster_job)
        made = attempt(member.cluster_job, AttemptOutcome.FAILED, minutes_ago=1)
        seat(made, member, WorkerFactory(zone=f"zone-{i % 4}"), DispatchedOutcome.FAILED)


def test_the_cluster_list_issues_a_bounded_number_of_queries(
    admin_client, django_assert_max_num_queries
):
    make_clusters(3)
    with CaptureQueriesContext(connection) as few:
        assert len(listed(admin_client, CLUSTERS)) == 3
    make_clusters(27)
    with django_assert_max_num_queries(len(few)):
        assert len(listed(admin_client, CLUSTERS)) == 30


@pytest.mark.parametrize(
    "name",
    ["jobs_project", "jobs_evaluation", "jobs_derivationbuild", "clusters_clusterattempt"],
)
def test_every_other_list_renders(admin_client, name):
    assert admin_client.get(reverse(f"admin:{name}_changelist")).status_code == 200


def test_the_cluster_list_filters_by_the_zone_its_seats_used(admin_client):
    cluster, _, _ = two_attempts()
    other = EvalMemberFactory(role="server")
    row = seat(attempt(other.cluster_job, "Failed", 1), other, WorkerFactory(name="c1", zone="c"))
    ClusterFactory()  # never seated

    assert listed(admin_client, CLUSTERS, zone="a") == {cluster}
    assert listed(admin_client, CLUSTERS, zone="c") == {other.cluster_job}
    assert listed(admin_client, CLUSTERS, zone="-") == {cluster}  # b2 has no zone
    assert listed(admin_client, CLUSTERS, zone="nowhere") == set()
    response = admin_client.get(CLUSTERS)
    [found] = [c for c in response.context["cl"].result_list if c == cluster]
    assert found.zones_used == ["a", "b", None]
    assert found.last_state == "Succeeded"
    assert row.worker.zone in response.text


def test_the_cluster_list_filters_by_age(admin_client):
    now = timezone.now()
    ages = {"minutes": timedelta(minutes=5), "hours": timedelta(hours=5), "days": timedelta(days=3)}
    ages["weeks"] = timedelta(days=30)
    made = {}
    for name, age in ages.items():
        made[name] = ClusterFactory()
        ClusterJob.objects.filter(pk=made[name].pk).update(created_at=now - age)

    def aged(value):
        return {c for c in listed(admin_client, CLUSTERS, age=value)}

    assert aged("hour") == {made["minutes"]}
    assert aged("day") == {made["minutes"], made["hours"]}
    assert aged("week") == {made["minutes"], made["hours"], made["days"]}
    assert aged("older") == {made["weeks"]}


def test_the_worker_list_shows_connection_live_idle_slots_and_what_runs_now(admin_client):
    now = timezone.now()
    busy = WorkerFactory(name="busy", channel_name="live", zone="a")
    idle = WorkerFactory(name="idle", channel_name="live", zone="b")
    gone = WorkerFactory(name="gone")
    IdleSlot.objects.create(worker=idle, kind="eval", recorded_at=now)
    IdleSlot.objects.create(worker=idle, kind="build", recorded_at=now)
    IdleSlot.objects.create(worker=busy, kind="eval", recorded_at=now - timedelta(minutes=5))
    keys = [f"build:{i:08d}-0000-0000-0000-000000000000" for i in range(5)]
    for i, key in enumerate(keys):  # listed in the order they were dispatched
        DispatchedJob.objects.create(
            kind=JobKind.BUILD,
            job_id=key,
            worker=busy,
            project=ProjectFactory(),
            dispatched_at=now - timedelta(minutes=10 - i),
        )
    url = reverse("admin:workers_worker_changelist")

    assert listed(admin_client, url, connection="connected") == {busy, idle}
    assert listed(admin_client, url, connection="disconnected") == {gone}
    assert listed(admin_client, url, zone="b") == {idle}
    rows = {w.name: w for w in listed(admin_client, url)}
    assert rows["idle"].idle_kinds == ["build", "eval"]
    assert rows["busy"].idle_kinds == []  # its slot is stale
    assert rows["busy"].running_keys == keys
    assert rows["gone"].running_keys == []
    admin = WorkerAdmin(Worker, site)
    assert admin.idle_now(rows["idle"]) == "build, eval"
    assert admin.running_now(rows["busy"]) == (
        f'<span class="running-now" title="{" ".join(keys)}">build:00000000, '
        "build:00000001, build:00000002 and 2 more</span>"
    )
    # Sorted by what runs now, most first (the column's index in list_display, descending; the
    # action checkbox is column 0).
    for order, where in [("-5", 0), ("5", -1)]:
        assert list(admin_client.get(url, {"o": order}).context["cl"].result_list)[where] == busy


def test_the_worker_list_issues_a_bounded_number_of_queries(
    admin_client, django_assert_max_num_queries
):
    def workers(n):
        for _ in range(n):
            worker = WorkerFactory(channel_name="live", zone="z")
            IdleSlot.objects.create(worker=worker, kind="eval", recorded_at=timezone.now())
            DispatchedJob.objects.create(
                kind=JobKind.EVAL,
                job_id=f"eval:{worker.pk}",
                worker=worker,
                project=ProjectFactory(),
                dispatched_at=timezone.now(),
            )

    url = reverse("admin:workers_worker_changelist")
    workers(3)
    with CaptureQueriesContext(connection) as few:
        assert len(listed(admin_client, url)) == 3
    workers(27)
    with django_assert_max_num_queries(len(few)):
        assert len(listed(admin_client, url)) == 30
