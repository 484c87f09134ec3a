"""The cluster page: members, attempts on one time axis with their seats, why it waits."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from clusters.cluster_page import LOG_ATTEMPTS, MAX_BARS
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


def test_each_seat_shows_how_it_ended_with_its_log_tail_escaped(admin_client):
    cluster, failed, done = two_attempts()
    client_seat = DispatchedJob.objects.get(cluster_attempt=failed, outcome="Failed")
    DispatchedJob.objects.filter(pk=client_seat.pk).update(
        failure_kind="permanent",
        error="exit status 1 <from make>",
        log_tail="make: *** [check] Error 1\n<script>alert(1)</script>\n",
    )
    DispatchedJob.objects.filter(cluster_attempt=done, job_id__startswith="eval:").update(
        log_tail="served 12 clients\n"
    )

    response = page(admin_client, cluster)

    failed_bar, _ = response.context["overview"]["timeline"]["bars"]
    ending = next(s for s in failed_bar["seats"] if s["label"] == "client/0")
    assert (ending["state"], ending["failure_kind"], ending["error"]) == (
        "Failed",
        "permanent",
        "exit status 1 <from make>",
    )
    assert ending["assignment_id"] == client_seat.pk
    text = response.text
    assert f'data-seat="client/0" data-assignment="{client_seat.pk}"' in text
    assert 'Failed (permanent): <span class="error">exit status 1 &lt;from make&gt;</span>' in text
    assert (
        '<div class="log-tail"><pre>make: *** [check] Error 1\n'
        "&lt;script&gt;alert(1)&lt;/script&gt;\n</pre></div>"
    ) in text
    assert "<script>alert(1)" not in text
    assert '<div class="log-tail"><pre>served 12 clients\n</pre></div>' in text
    # A seat that ended without a report's output or kind shows no ending line.
    abandoned = next(s for s in failed_bar["seats"] if s["label"] == "server/0")
    assert f'data-assignment="{abandoned["assignment_id"]}"' not in text


def test_older_attempts_link_to_their_seats_output_instead_of_showing_it(admin_client):
    server = EvalMemberFactory(role="server")
    cluster = server.cluster_job
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.FAILED)
    worker = WorkerFactory()
    t0 = timezone.now() - timedelta(hours=1)
    rows = []
    for i in range(LOG_ATTEMPTS + 1):
        at = t0 + timedelta(minutes=i)
        made = ClusterAttempt.objects.create(
            cluster_job=cluster, created_at=at, finished_at=at, outcome=AttemptOutcome.FAILED
        )
        rows.append(seat(made, server, worker, DispatchedOutcome.FAILED))
        DispatchedJob.objects.filter(pk=rows[-1].pk).update(log_tail=f"output of attempt {i}")

    response = page(admin_client, cluster)

    bars = response.context["overview"]["timeline"]["bars"]
    [oldest] = bars[0]["seats"]
    url = reverse("admin:jobs_dispatchedjob_change", args=[rows[0].pk])
    assert (oldest["log_tail"], oldest["log_url"]) == (None, url)
    assert "output of attempt 0" not in response.text and f'href="{url}"' in response.text
    for i, bar in enumerate(bars[1:], start=1):
        [shown] = bar["seats"]
        assert (shown["log_tail"], shown["log_url"]) == (f"output of attempt {i}", None)
    # The assignment's own page shows it, in a box of its own.
    assignment = admin_client.get(url)
    assert assignment.status_code == 200
    assert '<div class="log-tail"><pre>output of attempt 0</pre></div>' in assignment.text


def test_the_members_table_shows_what_each_member_runs(admin_client):
    server = EvalMemberFactory(
        role="server",
        evaluation__command=["python", "-m", "server", "--name=a b"],
        evaluation__env={"PORT": "80", "MODE": "<fast>"},
        evaluation__timeout_secs=600,
    )
    BuildMemberFactory(cluster_job=server.cluster_job, role="client")

    response = page(admin_client, server.cluster_job)

    members = {m["label"]: m for m in response.context["overview"]["members"]}
    assert (members["server/0"]["command"], members["server/0"]["env"]) == (
        "python -m server '--name=a b'",
        ["MODE=<fast>", "PORT=80"],
    )
    assert members["server/0"]["timeout_secs"] == 600
    assert (members["client/0"]["command"], members["client/0"]["env"]) == (None, [])
    text = response.text
    assert '<code class="command">python -m server &#x27;--name=a b&#x27;</code>' in text
    assert "<code>MODE=&lt;fast&gt;</code>" in text and "600 s" in text
    assert "no command" in text
