"""Aborting a cluster as an evaluation abort would: the Abort verdict for an open attempt,
one transaction for a waiting cluster, refusals that change nothing, the races, the operator
command and the admin action."""

import json
import time
from io import StringIO
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from clusters import coordinator
from clusters.abort import AbortRefused, AlreadyFinished, UnknownCluster, abort_cluster
from clusters.dispatch import run_pass
from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from clusters.settlement import member_report
from gradient.errors import NotAllowed
from gradient.jobs.models import BuildStatus, DispatchedJob, EvaluationStatus
from sessions.reports import job_failed
from tests.clusterflow import Inbox, idle_workers
from tests.commands import manage
from tests.concurrency import race
from tests.factories import BuildMemberFactory, ClusterFactory, EvalMemberFactory
from workers.models import IdleSlot

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = reverse("admin:clusters_clusterjob_changelist")
CONFIRMATION = "admin/clusters/clusterjob/abort_selected_confirmation.html"
ATTEMPT_OUTCOME = {
    ClusterStatus.ABORTED: AttemptOutcome.ABORTED,
    ClusterStatus.COMPLETED: AttemptOutcome.SUCCEEDED,
    ClusterStatus.FAILED: AttemptOutcome.FAILED,
}


@pytest.fixture(autouse=True)
def _layer(memory_layer):
    pass


# Set-up: a cluster of an evaluation ("server") and a build ("client") in each stage.


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


def assert_consistent(cluster):
    """Settled for good: no open attempt or member row, the last attempt's outcome matching
    the cluster's status, and no member job still going."""
    status, evaluation, build = statuses(cluster)
    assert status in ATTEMPT_OUTCOME
    assert not ClusterAttempt.objects.filter(cluster_job=cluster, finished_at__isnull=True)
    assert not DispatchedJob.objects.filter(
        cluster_attempt__cluster_job=cluster, finished_at__isnull=True
    )
    last = ClusterAttempt.objects.filter(cluster_job=cluster).order_by("created_at").last()
    if last is not None and status == ClusterStatus.ABORTED:
        assert last.outcome in (AttemptOutcome.ABORTED, AttemptOutcome.FAILED)
    elif last is not None:
        assert last.outcome == ATTEMPT_OUTCOME[status]
    assert evaluation in (EvaluationStatus.COMPLETED, EvaluationStatus.ABORTED)
    assert build in (BuildStatus.COMPLETED, BuildStatus.ABORTED)


# Waiting: no open attempt.


@pytest.mark.django_db
@pytest.mark.parametrize("status", [ClusterStatus.QUEUED, ClusterStatus.RUNNING])
def test_a_cluster_without_an_open_attempt_ends_aborted_with_its_member_jobs(status):
    # Running without an open attempt is the stranded state a crash can leave.
    cluster = waiting_cluster(status=status)
    workers = idle_workers(1)
    inbox = Inbox(workers)

    assert abort_cluster(cluster.pk, "operator") == ClusterStatus.ABORTED

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()
    assert inbox.frames(workers[0]) == []


@pytest.mark.django_db
def test_an_aborted_waiting_cluster_is_never_claimed():
    cluster = waiting_cluster()
    abort_cluster(cluster.pk)
    idle_workers(2)

    assert run_pass().claimed == []
    assert not ClusterAttempt.objects.filter(cluster_job=cluster).exists()


@pytest.mark.django_db
def test_a_member_job_that_already_ended_keeps_its_status():
    cluster = waiting_cluster()
    build = cluster.members.get(role="client").derivation_build
    type(build).objects.filter(pk=build.pk).update(status=BuildStatus.SUBSTITUTED)

    abort_cluster(cluster.pk)

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.SUBSTITUTED,
    )


# Preparing: an open attempt not yet started.


@pytest.mark.django_db
@pytest.mark.parametrize("accepted", [(), ("eval",)], ids=["none-accepted", "one-accepted"])
def test_a_preparing_cluster_closes_its_attempt_aborted_and_tells_every_held_member(accepted):
    cluster, rows, inbox, workers = preparing_cluster(accepted=accepted)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert statuses(cluster)[1:] == (EvaluationStatus.QUEUED, BuildStatus.BUILDING)

    assert abort_cluster(cluster.pk, "operator says stop") == ClusterStatus.ABORTED

    attempt.refresh_from_db()
    assert (attempt.outcome, attempt.started_at) == (AttemptOutcome.ABORTED, None)
    assert attempt.finished_at is not None
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    assert set(DispatchedJob.objects.filter(cluster_attempt=attempt).values_list("outcome")) == {
        ("Abandoned",)
    }
    for row in rows.values():
        assert inbox.frames(worker_of(row, workers)) == [
            {"type": "AbortCluster", "attempt": str(attempt.pk), "reason": "operator says stop"}
        ]


@pytest.mark.django_db
def test_a_preparing_cluster_aborted_never_starts():
    cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
    abort_cluster(cluster.pk)
    drain(inbox, workers)

    with pytest.raises(NotAllowed):  # its hold is gone
        coordinator.accept_assignment(rows["build"].worker_id, rows["build"].job_id)

    assert ClusterAttempt.objects.get(cluster_job=cluster).started_at is None
    assert statuses(cluster)[0] == ClusterStatus.ABORTED
    assert all(inbox.frames(w) == [] for w in workers)  # no StartCluster


# Running: a started attempt, decided with the Abort verdict.


@pytest.mark.django_db
def test_a_running_cluster_is_decided_abort_and_its_running_members_get_abort_job():
    cluster, rows, inbox, workers = running_cluster(retry_budget=3)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)

    assert abort_cluster(cluster.pk, "operator") == ClusterStatus.ABORTED

    attempt.refresh_from_db()
    assert attempt.outcome == AttemptOutcome.ABORTED
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    for row in rows.values():
        frames = inbox.frames(worker_of(row, workers))
        assert {"type": "AbortJob", "job_id": row.job_id, "reason": "operator"} in frames
        assert {"type": "AbortCluster", "attempt": str(attempt.pk), "reason": "operator"} in frames
        assert len(frames) == 2


@pytest.mark.django_db
def test_a_member_that_completed_settles_completed_and_only_the_survivor_is_aborted():
    cluster, rows, inbox, workers = running_cluster(retry_budget=3)
    assert report(rows["build"], "Completed") is None  # not primary: the attempt goes on

    abort_cluster(cluster.pk, "operator")

    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.COMPLETED,
    )
    assert inbox.frames(worker_of(rows["build"], workers)) == []
    frames = inbox.frames(worker_of(rows["eval"], workers))
    assert [f["type"] for f in frames] == ["AbortCluster", "AbortJob"]
    assert frames[1]["job_id"] == rows["eval"].job_id
    outcomes = dict(
        DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster).values_list(
            "kind", "outcome"
        )
    )
    assert outcomes == {"build": "Completed", "eval": "Abandoned"}


@pytest.mark.django_db
def test_the_aborted_workers_later_job_failed_reports_are_accepted_and_change_nothing():
    cluster, rows, _, _ = running_cluster()
    abort_cluster(cluster.pk)
    before = snapshot(cluster)

    for row in rows.values():
        job_failed(row.worker_id, row.job_id, str(row.pk), "aborted")

    assert snapshot(cluster) == before
    assert statuses(cluster)[0] == ClusterStatus.ABORTED


# Refusals: nothing changed.


@pytest.mark.django_db
@pytest.mark.parametrize(
    "status", [ClusterStatus.COMPLETED, ClusterStatus.FAILED, ClusterStatus.ABORTED]
)
def test_a_finished_cluster_is_refused_and_nothing_changes(status):
    cluster = waiting_cluster(status=status)
    before = snapshot(cluster)

    with pytest.raises(AlreadyFinished, match=f"^cluster {cluster.pk} is already {status}$"):
        abort_cluster(cluster.pk)

    assert snapshot(cluster) == before


@pytest.mark.django_db
def test_a_cluster_a_report_completed_is_refused_and_its_workers_hear_nothing():
    cluster, rows, inbox, workers = running_cluster()
    assert report(rows["eval"], "Completed") == "Complete"  # the primary
    drain(inbox, workers)
    before = snapshot(cluster)

    with pytest.raises(AlreadyFinished, match="already Completed"):
        abort_cluster(cluster.pk)

    assert snapshot(cluster) == before
    assert all(inbox.frames(w) == [] for w in workers)


@pytest.mark.django_db
def test_an_unknown_cluster_is_refused():
    with pytest.raises(UnknownCluster, match=r"^unknown cluster 424242$"):
        abort_cluster(424242)


@pytest.mark.django_db
def test_an_overlong_reason_is_refused_and_nothing_changes():
    cluster = waiting_cluster()
    before = snapshot(cluster)

    with pytest.raises(AbortRefused, match="reason is longer"):
        abort_cluster(cluster.pk, "x" * 1001)

    assert snapshot(cluster) == before


# Races, on real concurrent connections.


def outcome_of(call):
    """The call's result, or its refusal's message: a race's loser refuses, it never breaks."""

    def run():
        try:
            return call()
        except (AbortRefused, NotAllowed) as refused:
            return str(refused)

    return run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stage", ["waiting", "preparing", "running"])
def test_two_simultaneous_aborts_abort_once_and_the_other_is_refused(stage):
    for _ in range(8):
        if stage == "waiting":
            cluster, rows, inbox, workers = waiting_cluster(), {}, Inbox([]), []
        elif stage == "preparing":
            cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
        else:
            cluster, rows, inbox, workers = running_cluster()

        results = race(
            outcome_of(lambda c=cluster: abort_cluster(c.pk, "a")),
            outcome_of(lambda c=cluster: abort_cluster(c.pk, "b")),
        )

        assert sorted(results) == ["Aborted", f"cluster {cluster.pk} is already Aborted"]
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        for row in rows.values():
            types = sorted(f["type"] for f in inbox.frames(worker_of(row, workers)))
            # Told once, by the abort that won.
            assert types == (
                ["AbortCluster"] if stage == "preparing" else ["AbortCluster", "AbortJob"]
            )


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_the_primarys_deciding_report_leaves_one_consistent_verdict():
    for _ in range(15):
        cluster, rows, _, _ = running_cluster()
        aborted, verdict = race(
            outcome_of(lambda c=cluster: abort_cluster(c.pk)),
            outcome_of(lambda r=rows: report(r["eval"], "Completed")),
        )
        status, evaluation, build = statuses(cluster)
        if status == ClusterStatus.ABORTED:  # the abort decided; the report came late
            assert (aborted, verdict) == ("Aborted", None)
            assert (evaluation, build) == (EvaluationStatus.ABORTED, BuildStatus.ABORTED)
        else:  # the report decided Complete; the abort found the cluster finished
            assert (aborted, verdict) == (f"cluster {cluster.pk} is already Completed", "Complete")
            assert (status, evaluation, build) == (
                ClusterStatus.COMPLETED,
                EvaluationStatus.COMPLETED,
                BuildStatus.ABORTED,
            )
        assert_consistent(cluster)
        assert ClusterAttempt.objects.filter(cluster_job=cluster).count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_a_failing_report_with_a_retry_left_still_aborts():
    for _ in range(15):
        cluster, rows, _, _ = running_cluster(retry_budget=1)
        aborted, verdict = race(
            outcome_of(lambda c=cluster: abort_cluster(c.pk)),
            outcome_of(lambda r=rows: report(r["build"], "Failed", "transient")),
        )
        # Either the abort decided (the report came late) or the report decided Retry and
        # the abort then ended the queued cluster: it never stays queued.
        assert aborted == "Aborted"
        assert verdict in (None, "Retry")
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_the_last_acceptance_aborts_whether_or_not_the_attempt_started():
    for _ in range(15):
        cluster, rows, inbox, workers = preparing_cluster(accepted=["eval"])
        build = rows["build"]
        aborted, _started = race(
            outcome_of(lambda c=cluster: abort_cluster(c.pk)),
            outcome_of(lambda r=build: coordinator.accept_assignment(r.worker_id, r.job_id)),
        )
        assert aborted == "Aborted"
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        attempt = ClusterAttempt.objects.get(cluster_job=cluster)
        assert attempt.outcome == AttemptOutcome.ABORTED
        types = {f["type"] for f in inbox.frames(worker_of(build, workers))}
        # A start that won is followed by the abort of running members.
        assert ("AbortJob" in types) == (attempt.started_at is not None)
        assert "AbortCluster" in types


@pytest.mark.django_db(transaction=True)
def test_an_abort_racing_a_claim_leaves_the_cluster_aborted_and_nothing_open():
    for i in range(12):
        cluster = waiting_cluster()
        IdleSlot.objects.all().delete()
        idle_workers(2)

        def late_abort(c=cluster, delay=i * 0.02):
            # The pass plans before it claims: a growing head start lets the claim win too.
            time.sleep(delay)
            return abort_cluster(c.pk)

        aborted, result = race(outcome_of(late_abort), run_pass)
        assert aborted == "Aborted"
        assert statuses(cluster) == (
            ClusterStatus.ABORTED,
            EvaluationStatus.ABORTED,
            BuildStatus.ABORTED,
        )
        assert_consistent(cluster)
        if result.claimed:  # the abort closed the claimed attempt before it started
            attempt = ClusterAttempt.objects.get(cluster_job=cluster)
            assert (attempt.outcome, attempt.started_at) == (AttemptOutcome.ABORTED, None)


# The operator command.


def run_command(*args) -> dict:
    out = StringIO()
    call_command("abort_cluster", *args, stdout=out)
    (line,) = out.getvalue().splitlines()
    return json.loads(line)


def refusal(*args) -> str:
    out = StringIO()
    with pytest.raises(CommandError) as refused:
        call_command("abort_cluster", *args, stdout=out)
    assert out.getvalue() == ""
    message = str(refused.value)
    assert message and "\n" not in message
    return message


@pytest.mark.django_db
def test_the_command_prints_the_aborted_cluster():
    cluster, rows, inbox, workers = running_cluster()

    assert run_command(str(cluster.pk), "--reason", "maintenance") == {
        "cluster": cluster.pk,
        "status": "Aborted",
    }

    assert statuses(cluster)[0] == ClusterStatus.ABORTED
    frames = inbox.frames(worker_of(rows["eval"], workers))
    assert {"type": "AbortJob", "job_id": rows["eval"].job_id, "reason": "maintenance"} in frames


@pytest.mark.django_db
def test_the_command_refuses_in_one_line_and_changes_nothing():
    finished = waiting_cluster(status=ClusterStatus.COMPLETED)
    queued = waiting_cluster()
    before = snapshot(finished), snapshot(queued)

    assert refusal(str(finished.pk)) == f"cluster {finished.pk} is already Completed"
    assert refusal("424242") == "unknown cluster 424242"
    assert refusal(str(2**70)) == f"unknown cluster {2**70}"
    assert "given more than once" in refusal(str(queued.pk), "--reason=a", "--reason=b")
    assert "invalid int value" in refusal("nope")

    assert (snapshot(finished), snapshot(queued)) == before


@pytest.mark.django_db(transaction=True)
def test_the_command_run_as_a_process_prints_one_json_object_or_one_error_line():
    cluster = waiting_cluster()

    done = manage("abort_cluster", str(cluster.pk), "--reason", "maintenance")

    assert done.returncode == 0
    assert done.stdout == f'{{"cluster": {cluster.pk}, "status": "Aborted"}}\n'
    assert "Error" not in done.stderr  # at most the log's INFO line
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )

    again = manage("abort_cluster", str(cluster.pk))

    assert again.returncode != 0
    assert again.stdout == ""
    assert again.stderr.splitlines() == [f"CommandError: cluster {cluster.pk} is already Aborted"]


# The admin action.


def action(client, clusters, **extra):
    data = {"action": "abort_selected", "_selected_action": [c.pk for c in clusters], **extra}
    return client.post(CLUSTERS, data, follow="post" in extra)


def staff(django_user_model, *perms):
    user = django_user_model.objects.create_user("ops", password="x", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


@pytest.mark.django_db
def test_the_action_asks_for_confirmation_listing_the_clusters_and_their_status(admin_client):
    queued, done = waiting_cluster(), waiting_cluster(status=ClusterStatus.COMPLETED)

    response = action(admin_client, [queued, done])

    assert response.status_code == 200
    assert response.templates[0].name == CONFIRMATION
    assert [(c.pk, finished) for c, finished in response.context["clusters"]] == [
        (queued.pk, False),
        (done.pk, True),
    ]
    text = response.text
    assert f"cluster {queued.pk}" in text and f"cluster {done.pk}" in text
    assert "will be aborted" in text and "skipped: already Completed" in text
    assert 'name="reason"' in text
    assert statuses(queued)[0] == ClusterStatus.QUEUED  # nothing done yet


@pytest.mark.django_db
def test_confirming_aborts_the_clusters_and_skips_the_finished_ones(admin_client):
    cluster, rows, inbox, workers = preparing_cluster()
    done = waiting_cluster(status=ClusterStatus.COMPLETED)
    before = snapshot(done)

    response = action(admin_client, [cluster, done], post="yes", reason="maintenance")

    assert response.redirect_chain[-1][0] == CLUSTERS
    assert statuses(cluster) == (
        ClusterStatus.ABORTED,
        EvaluationStatus.ABORTED,
        BuildStatus.ABORTED,
    )
    assert snapshot(done) == before
    assert [str(m) for m in response.context["messages"]] == [
        f"Aborted cluster(s) {cluster.pk}.",
        f"Skipped: cluster {done.pk} is already Completed.",
    ]
    frames = inbox.frames(worker_of(rows["eval"], workers))
    assert [(f["type"], f["reason"]) for f in frames] == [("AbortCluster", "maintenance")]


@pytest.mark.django_db
def test_a_blank_reason_names_the_user(admin_client):
    cluster, rows, inbox, workers = running_cluster()

    action(admin_client, [cluster], post="yes", reason="")

    frames = inbox.frames(worker_of(rows["eval"], workers))
    assert {f["reason"] for f in frames} == {"aborted by admin"}


@pytest.mark.django_db
def test_staff_with_the_change_permission_may_abort_but_the_form_stays_read_only(
    client, django_user_model
):
    client.force_login(staff(django_user_model, "view_clusterjob", "change_clusterjob"))
    cluster = waiting_cluster()
    change = reverse("admin:clusters_clusterjob_change", args=[cluster.pk])
    assert client.post(change, {"status": "Aborted"}).status_code == 403
    assert statuses(cluster)[0] == ClusterStatus.QUEUED

    assert "abort_selected" in client.get(CLUSTERS).text
    action(client, [cluster], post="yes", reason="")

    assert statuses(cluster)[0] == ClusterStatus.ABORTED


@pytest.mark.django_db
def test_staff_without_the_change_permission_cannot_abort(client, django_user_model):
    client.force_login(staff(django_user_model, "view_clusterjob"))
    cluster = waiting_cluster()

    assert client.get(CLUSTERS).status_code == 200
    assert "abort_selected" not in client.get(CLUSTERS).text
    response = action(client, [cluster])  # no such action for this user: just the list
    assert CONFIRMATION not in [t.name for t in response.templates]
    action(client, [cluster], post="yes", reason="")

    assert statuses(cluster)[0] == ClusterStatus.QUEUED


@pytest.mark.django_db
def test_a_user_who_is_not_staff_cannot_abort(client, django_user_model):
    user = django_user_model.objects.create_user("someone", password="x")
    user.user_permissions.add(Permission.objects.get(codename="change_clusterjob"))
    client.force_login(user)
    cluster = waiting_cluster()

    response = action(client, [cluster], post="yes", reason="")

    assert response.redirect_chain[0][0].startswith(reverse("admin:login"))
    assert statuses(cluster)[0] == ClusterStatus.QUEUED
