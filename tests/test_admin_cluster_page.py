"""The cluster page: members, attempts on one time axis with their seats, why it waits."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from clusters.cluster_page import MAX_BARS
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob, DispatchedOutcome
from tests.admin_rows import seat, two_attempts
from tests.factories import (
    BuildMemberFactory,
    EvalMemberFactory,
    WorkerFactory,
)
from workers.models import IdleSlot

pytestmark = pytest.mark.django_db


def page(client, cluster):
    response = client.get(reverse("admin:clusters_clusterjob_change", args=[cluster.pk]))
    assert response.status_code == 200
    return response


def test_the_cluster_page_draws_each_attempt_with_its_seats(admin_client):
    cluster, failed, done = two_attempts()

    response = page(admin_client, cluster)

    view = response.context["overview"]
    assert [m["label"] for m in view["members"]] == ["client/0", "server/0"]
    assert view["explanation"] is None  # not waiting
    bars = view["timeline"]["bars"]
    assert [(b["number"], b["attempt"], b["state"]) for b in bars] == [
        (1, failed, "PrepareFailed"),
        (2, done, "Succeeded"),
    ]
    assert [
        [(s["label"], s["worker"], s["zone"], s["state"]) for s in b["seats"]] for b in bars
    ] == [
        [("client/0", "a2", "a", "Failed"), ("server/0", "a1", "a", "Abandoned")],
        [("client/0", "b2", None, "Completed"), ("server/0", "b1", "b", "Completed")],
    ]
    text = response.text
    assert text.count('class="timeline-row attempt-row"') == 2
    assert f'data-attempt="{failed.pk}" data-outcome="PrepareFailed"' in text
    assert f'data-attempt="{done.pk}" data-outcome="Succeeded"' in text
    assert 'data-seat="server/0" data-worker="b1" data-outcome="Completed"' in text
    assert "zone b" in text and "no zone" in text


def test_the_page_of_a_cluster_without_attempts_says_so(admin_client):
    cluster = EvalMemberFactory().cluster_job
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.FAILED)
    response = page(admin_client, cluster)
    assert response.context["overview"]["timeline"] is None
    assert "No attempts yet." in response.text


def test_an_open_attempt_shows_its_held_and_accepted_seats(admin_client):
    server = EvalMemberFactory(role="server")
    client = BuildMemberFactory(cluster_job=server.cluster_job, role="client")
    open_attempt = ClusterAttempt.objects.create(
        cluster_job=server.cluster_job, created_at=timezone.now() - timedelta(seconds=5)
    )
    seat(open_attempt, server, WorkerFactory(name="w1"))
    DispatchedJob.objects.filter(pk=seat(open_attempt, client, WorkerFactory(name="w2")).pk).update(
        accepted_at=timezone.now()
    )

    view = page(admin_client, server.cluster_job).context["overview"]

    [bar] = view["timeline"]["bars"]
    assert (bar["state"], bar["open"], bar["left"], bar["width"]) == ("open", True, 0, 100)
    assert [(s["label"], s["state"]) for s in bar["seats"]] == [
        ("client/0", "accepted"),
        ("server/0", "held"),
    ]
    # Queued with an open attempt: explain says it is preparing, with no candidates to list.
    assert view["explanation"]["waiting"] is False
    assert view["explanation"]["summary"].startswith("preparing: attempt")


def test_a_waiting_cluster_shows_why_it_waits_and_its_candidates(admin_client):
    cluster = BuildMemberFactory(role="client").cluster_job
    EvalMemberFactory(cluster_job=cluster, role="server")
    now = timezone.now()
    for name, kinds in [("w1", ["build"]), ("w2", ["eval", "build"]), ("w3", [])]:
        worker = WorkerFactory(name=name, channel_name="live", last_seen_at=now)
        for kind in kinds:
            IdleSlot.objects.create(worker=worker, kind=kind, recorded_at=now)

    response = page(admin_client, cluster)

    explanation = response.context["overview"]["explanation"]
    assert explanation["waiting"] is True
    assert explanation["summary"].startswith("Not blocked: every member has a seat")
    by_member = {m["member"]: m for m in explanation["members"]}
    assert by_member["client/0"]["candidates"] == ["w1", "w2"]
    assert by_member["server/0"]["candidates"] == ["w2"]
    assert by_member["server/0"]["groups"] == [
        {"reason": "no idle slot of that kind", "workers": ["w1", "w3"], "more": 0, "count": 2}
    ]
    assert explanation["summary"] in response.text
    assert 'data-member="server/0"' in response.text


def test_the_page_draws_the_newest_attempts_in_a_bounded_number_of_queries(
    admin_client, django_assert_max_num_queries
):
    server = EvalMemberFactory(role="server")
    cluster = server.cluster_job
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.FAILED)
    worker = WorkerFactory()
    t0 = timezone.now() - timedelta(hours=2)

    def attempts(first, last):
        for i in range(first, last):
            at = t0 + timedelta(minutes=i)
            made = ClusterAttempt.objects.create(
                cluster_job=cluster,
                created_at=at,
                finished_at=at + timedelta(seconds=20),
                outcome=AttemptOutcome.PREPARE_FAILED,
            )
            seat(made, server, worker, DispatchedOutcome.ABANDONED)

    attempts(0, 2)
    with CaptureQueriesContext(connection) as few:
        page(admin_client, cluster)
    attempts(2, MAX_BARS + 10)
    with django_assert_max_num_queries(len(few)):
        response = page(admin_client, cluster)
    bars = response.context["overview"]["timeline"]["bars"]
    assert len(bars) == MAX_BARS
    assert (bars[0]["number"], bars[-1]["number"]) == (11, MAX_BARS + 10)
    assert response.text.count('class="timeline-row attempt-row"') == MAX_BARS
    assert "all of them" in response.text
