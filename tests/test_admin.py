"""The admin: staff only, read-only where the scheduler writes, and never the token hash."""

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.contrib.admin import site
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from clusters.cluster_page import MAX_BARS, duration, timeline
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import DispatchedJob, DispatchedOutcome, JobKind
from tests.factories import (
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    ProjectFactory,
    WorkerFactory,
)
from workers.admin import WorkerAdmin
from workers.models import IdleSlot, Worker, hash_token

pytestmark = pytest.mark.django_db

CLUSTERS = reverse("admin:clusters_clusterjob_changelist")


def attempt(cluster, outcome, minutes_ago):
    at = timezone.now() - timedelta(minutes=minutes_ago)
    return ClusterAttempt.objects.create(
        cluster_job=cluster, created_at=at, started_at=at, finished_at=at, outcome=outcome
    )


def dispatched(worker, cluster_attempt=None):
    project = ProjectFactory()
    return DispatchedJob.objects.create(
        kind=JobKind.EVAL,
        job_id="eval:00000000-0000-0000-0000-000000000001",
        worker=worker,
        project=project,
        dispatched_at=timezone.now(),
        cluster_attempt=cluster_attempt,
    )


def listed(client, url, **params):
    response = client.get(url, params)
    assert response.status_code == 200
    return set(response.context["cl"].result_list)


def test_an_anonymous_user_is_sent_to_the_login_page(client):
    response = client.get(CLUSTERS)
    assert response.status_code == 302
    assert response.url.startswith(reverse("admin:login"))


def test_a_logged_in_user_who_is_not_staff_is_sent_to_the_login_page(client, django_user_model):
    cluster = ClusterFactory()
    user = django_user_model.objects.create_user("someone", password="not-staff-1234")
    client.force_login(user)

    for url in (
        reverse("admin:index"),
        CLUSTERS,
        reverse("admin:clusters_clusterjob_change", args=[cluster.pk]),
        reverse("admin:workers_worker_changelist"),
    ):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response.url.startswith(reverse("admin:login")), url
    assert client.get(CLUSTERS, follow=True).context["user"] == user  # still logged in


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


def test_the_cluster_detail_shows_member_roles_and_attempt_outcomes(admin_client):
    server = EvalMemberFactory(role="server", primary=True)
    client = BuildMemberFactory(cluster_job=server.cluster_job, role="client", pin="worker-7")
    attempt(server.cluster_job, AttemptOutcome.PREPARE_FAILED, minutes_ago=5)
    attempt(server.cluster_job, AttemptOutcome.SUCCEEDED, minutes_ago=1)
    url = reverse("admin:clusters_clusterjob_change", args=[server.cluster_job.pk])
    response = admin_client.get(url)
    assert response.status_code == 200
    for text in [
        "server",
        "client",
        "worker-7",
        server.job_key,
        client.job_key,
        AttemptOutcome.PREPARE_FAILED.label,
        AttemptOutcome.SUCCEEDED.label,
    ]:
        assert text in response.text


def test_clusters_cannot_be_added_changed_or_deleted_in_the_admin(admin_client):
    cluster = ClusterFactory(status=ClusterStatus.QUEUED)
    assert admin_client.get(reverse("admin:clusters_clusterjob_add")).status_code == 403
    change = reverse("admin:clusters_clusterjob_change", args=[cluster.pk])
    assert admin_client.post(change, {"status": "Aborted"}).status_code == 403
    delete = reverse("admin:clusters_clusterjob_delete", args=[cluster.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    cluster.refresh_from_db()
    assert cluster.status == ClusterStatus.QUEUED


def test_the_attempt_detail_shows_its_dispatched_rows(admin_client):
    member = EvalMemberFactory()
    row = dispatched(WorkerFactory(name="seat-1"), attempt(member.cluster_job, "Failed", 1))
    url = reverse("admin:clusters_clusterattempt_change", args=[row.cluster_attempt_id])
    response = admin_client.get(url)
    assert response.status_code == 200
    assert row.job_id in response.text
    assert "seat-1" in response.text


def test_the_worker_pages_never_show_the_token_hash(admin_client):
    worker = WorkerFactory(token_hash=hash_token("the-secret-token"))
    for url in [
        reverse("admin:workers_worker_changelist"),
        reverse("admin:workers_worker_change", args=[worker.pk]),
    ]:
        response = admin_client.get(url)
        assert response.status_code == 200
        assert worker.name in response.text
        assert worker.token_hash not in response.text


def test_workers_cannot_be_added_in_the_admin(admin_client):
    assert admin_client.get(reverse("admin:workers_worker_add")).status_code == 403


def test_revoking_a_worker_keeps_its_token_and_the_sessions_connection_state(
    admin_client, monkeypatch
):
    worker = WorkerFactory(channel_name="specific.abc")
    token_hash = worker.token_hash

    # The session disconnects while the admin is saving the form it read before.
    save_form = WorkerAdmin.save_form

    def disconnect_meanwhile(self, request, form, change):
        Worker.objects.filter(pk=worker.pk).update(channel_name=None)
        return save_form(self, request, form, change)

    monkeypatch.setattr(WorkerAdmin, "save_form", disconnect_meanwhile)
    now = timezone.now()
    response = admin_client.post(
        reverse("admin:workers_worker_change", args=[worker.pk]),
        {
            "revoked_at_0": now.strftime("%Y-%m-%d"),
            "revoked_at_1": now.strftime("%H:%M:%S"),
            "all_projects": "on",
            "token_hash": "forged",
            "channel_name": "specific.forged",
        },
    )
    assert response.status_code == 302
    worker.refresh_from_db()
    assert worker.revoked_at is not None
    assert worker.token_hash == token_hash
    assert worker.channel_name is None


def test_a_dispatched_job_cannot_be_changed_in_the_admin(admin_client):
    row = dispatched(WorkerFactory())
    url = reverse("admin:jobs_dispatchedjob_change", args=[row.pk])
    assert admin_client.get(url).status_code == 200
    response = admin_client.post(
        url, {"outcome": DispatchedOutcome.COMPLETED, "finished_at": "2030-01-01 00:00"}
    )
    assert response.status_code == 403
    row.refresh_from_db()
    assert row.finished_at is None
    assert row.outcome is None
    assert admin_client.get(reverse("admin:jobs_dispatchedjob_add")).status_code == 403


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


# The cluster page: members, attempts on one time axis with their seats, why it waits.

T0 = datetime(2030, 1, 2, 10, 0, tzinfo=UTC)


def times(created, started=None, finished=None, outcome=None):
    """An attempt as timeline() reads it, minutes after T0."""
    at = lambda minutes: None if minutes is None else T0 + timedelta(minutes=minutes)  # noqa: E731
    return SimpleNamespace(
        created_at=at(created), started_at=at(started), finished_at=at(finished), outcome=outcome
    )


def place(bar):
    return {k: bar[k] for k in ("left", "width", "started", "run_width", "state")}


def test_the_timeline_puts_every_attempt_on_one_axis_from_the_first_creation_to_the_last_finish():
    line = timeline(
        [
            times(0, finished=10, outcome=AttemptOutcome.PREPARE_FAILED),
            times(20, started=22, finished=40, outcome=AttemptOutcome.SUCCEEDED),
        ],
        now=T0 + timedelta(hours=5),  # nothing open: now plays no part
    )
    assert (line["start"], line["end"], line["to_now"]) == (T0, T0 + timedelta(minutes=40), False)
    assert [place(b) for b in line["bars"]] == [
        {"left": 0, "width": 25, "started": None, "run_width": None, "state": "PrepareFailed"},
        {"left": 50, "width": 50, "started": 55, "run_width": 45, "state": "Succeeded"},
    ]
    assert [(t["at"], t["label"]) for t in line["ticks"]] == [
        (0, "10:00"),
        (25, "10:10"),
        (50, "10:20"),
        (75, "10:30"),
        (100, "10:40"),
    ]


def test_an_open_attempt_runs_to_now_and_the_axis_with_it():
    now = T0 + timedelta(minutes=60)
    line = timeline([times(0, 1, 20, AttemptOutcome.FAILED), times(30, 33)], now=now)
    assert (line["end"], line["to_now"]) == (now, True)
    failed, running = line["bars"]
    assert place(failed) == {
        "left": 0,
        "width": 33.333,
        "started": 1.667,
        "run_width": 31.666,
        "state": "Failed",
    }
    assert place(running) == {
        "left": 50,
        "width": 50,
        "started": 55,
        "run_width": 45,
        "state": "open",
    }
    assert running["open"] and running["ran_for"] == timedelta(minutes=27)
    # Still preparing: the whole bar is the prepare part, up to now.
    [held] = timeline([times(0)], now=T0 + timedelta(seconds=30))["bars"]
    assert place(held) == {
        "left": 0,
        "width": 100,
        "started": None,
        "run_width": None,
        "state": "open",
    }


@pytest.mark.parametrize(
    ("outcome", "colour"),
    [
        (AttemptOutcome.SUCCEEDED, "#2e9d4f"),  # green
        (AttemptOutcome.FAILED, "#d0413c"),  # red
        (AttemptOutcome.PREPARE_FAILED, "#f0a01e"),  # amber
        (AttemptOutcome.ABORTED, "#8b8f94"),  # grey
        (None, "#2f7ed8"),  # open: blue
    ],
)
def test_a_bar_is_coloured_by_its_outcome(outcome, colour):
    finished = None if outcome is None else 5
    [bar] = timeline([times(0, 1, finished, outcome)], now=T0 + timedelta(minutes=9))["bars"]
    assert bar["colour"] == colour


def test_an_instant_attempt_is_still_drawn_and_no_attempts_draw_nothing():
    [bar] = timeline([times(0, finished=0, outcome=AttemptOutcome.ABORTED)], now=T0)["bars"]
    assert (bar["left"], bar["width"]) == (0, 0)
    assert bar["draw_width"] > 0
    line = timeline([times(0, 0, 10, "Failed"), times(10, finished=10, outcome="Aborted")], T0)
    last = line["bars"][-1]
    assert (last["left"], last["width"]) == (100, 0)
    assert last["draw_left"] + last["draw_width"] == 100  # kept inside the axis
    assert timeline([], now=T0) is None


def test_durations_read_at_a_glance():
    assert [
        duration(timedelta(seconds=s)) for s in (0, 3, 62, 3600 + 5 * 60 + 9, 2 * 86400 + 3 * 3600)
    ] == ["0s", "3s", "1m 02s", "1h 05m", "2d 3h"]


def seat(cluster_attempt, member, worker, outcome=None):
    return DispatchedJob.objects.create(
        kind=member.kind,
        job_id=member.job_key,
        worker=worker,
        project=member.cluster_job.project,
        dispatched_at=cluster_attempt.created_at,
        finished_at=cluster_attempt.finished_at,
        outcome=outcome,
        cluster_attempt=cluster_attempt,
    )


def two_attempts():
    """A cluster that failed its prepare once on zone a, then succeeded on zone b."""
    server = EvalMemberFactory(role="server", primary=True)
    cluster = server.cluster_job
    client = BuildMemberFactory(cluster_job=cluster, role="client")
    ClusterJob.objects.filter(pk=cluster.pk).update(status=ClusterStatus.COMPLETED, attempts=1)
    t0 = timezone.now() - timedelta(minutes=30)
    failed = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0,
        finished_at=t0 + timedelta(seconds=30),
        outcome=AttemptOutcome.PREPARE_FAILED,
    )
    done = ClusterAttempt.objects.create(
        cluster_job=cluster,
        created_at=t0 + timedelta(minutes=1),
        started_at=t0 + timedelta(minutes=2),
        finished_at=t0 + timedelta(minutes=20),
        outcome=AttemptOutcome.SUCCEEDED,
    )
    a1, a2 = WorkerFactory(name="a1", zone="a"), WorkerFactory(name="a2", zone="a")
    b1, b2 = WorkerFactory(name="b1", zone="b"), WorkerFactory(name="b2", zone=None)
    seat(failed, server, a1, DispatchedOutcome.ABANDONED)
    seat(failed, client, a2, DispatchedOutcome.FAILED)
    seat(done, server, b1, DispatchedOutcome.COMPLETED)
    seat(done, client, b2, DispatchedOutcome.COMPLETED)
    return cluster, failed, done


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


# The lists: filters, and columns from annotations.


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
    # Sorted by what runs now, most first (the column's index in list_display, descending).
    for order, where in [("-4", 0), ("4", -1)]:
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
