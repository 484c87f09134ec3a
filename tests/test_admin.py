"""The admin: staff only, read-only where the scheduler writes, and never the token hash."""

import pytest
from django.urls import reverse
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterStatus
from gradient.jobs.models import DispatchedOutcome
from tests.admin_rows import CLUSTERS, attempt, dispatched
from tests.factories import (
    BuildMemberFactory,
    ClusterFactory,
    EvalMemberFactory,
    WorkerFactory,
)
from workers.admin import WorkerAdmin
from workers.models import Worker, hash_token

pytestmark = pytest.mark.django_db


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
