"""The operator's ways to abort a cluster: the abort_cluster command and the admin action."""

import json
from io import StringIO
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from clusters.models import ClusterStatus
from gradient.jobs.models import BuildStatus, EvaluationStatus
from tests.aborting import (
    preparing_cluster,
    running_cluster,
    snapshot,
    statuses,
    waiting_cluster,
    worker_of,
)
from tests.clusterflow import committed
from tests.commands import manage

pytestmark = pytest.mark.usefixtures("memory_layer")


ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = reverse("admin:clusters_clusterjob_changelist")
CONFIRMATION = "admin/clusters/clusterjob/abort_selected_confirmation.html"


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


@committed
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


@committed
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


@committed
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
