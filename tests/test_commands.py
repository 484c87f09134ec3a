"""The operator commands (shared protocol.md, "Operator commands"): one JSON object on stdout,
or a one-line refusal on stderr that leaves every table as it was. Here: create_project,
create_worker, submit_job, and commands run as real processes; the cluster commands and the
refusals have files of their own."""

import asyncio
import logging
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection

from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationStatus,
    Project,
)
from gradient.wire.groups import worker_group
from tests.commands import manage, run
from tests.factories import ProjectFactory, WorkerFactory
from workers.models import Worker, hash_token

ROOT = Path(__file__).resolve().parent.parent
IN_MEMORY_LAYER = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

pytestmark = pytest.mark.django_db


# create_project


def test_create_project_prints_the_new_project():
    assert run("create_project", "web") == {"project": "web"}
    assert Project.objects.filter(name="web").exists()


# create_worker


def test_a_new_worker_gets_a_token_of_which_only_the_hash_is_stored():
    out = run("create_worker", "w1")

    worker = Worker.objects.get(name="w1")
    token = out["token"]
    assert out == {"worker": "w1", "token": token}
    assert len(token) >= 40
    assert worker.token_hash == hash_token(token)
    assert worker.all_projects
    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(worker)::text FROM worker WHERE id = %s", [worker.pk])
        (row,) = cursor.fetchone()
    assert token not in row


def test_two_workers_get_different_tokens():
    assert run("create_worker", "a")["token"] != run("create_worker", "b")["token"]


def test_a_worker_created_with_projects_may_access_only_those():
    web, db = ProjectFactory(name="web"), ProjectFactory(name="db")
    ProjectFactory(name="other")

    run("create_worker", "w1", "--projects", "web,db")

    worker = Worker.objects.get(name="w1")
    assert not worker.all_projects
    assert set(worker.projects.all()) == {web, db}


def test_revoke_sets_revoked_at_and_asks_the_live_session_to_close_after_commit(
    settings, django_capture_on_commit_callbacks
):
    settings.CHANNEL_LAYERS = IN_MEMORY_LAYER
    worker = WorkerFactory(name="w1")
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(worker_group(worker.pk), channel)

    with django_capture_on_commit_callbacks() as callbacks:
        assert run("create_worker", "w1", "--revoke") == {"worker": "w1", "revoked": True}
    worker.refresh_from_db()
    assert worker.revoked_at is not None
    assert len(callbacks) == 1  # nothing is sent before the commit

    callbacks[0]()
    message = async_to_sync(asyncio.wait_for)(layer.receive(channel), 1)
    assert message == {"type": "worker.revoked"}


def test_revoke_succeeds_with_a_warning_when_the_channel_layer_is_unreachable(
    settings, django_capture_on_commit_callbacks, caplog
):
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"]},
        }
    }
    WorkerFactory(name="w1")

    with (
        caplog.at_level(logging.WARNING, logger="gradient.wire.groups"),
        django_capture_on_commit_callbacks(execute=True),
    ):
        out = run("create_worker", "w1", "--revoke")

    assert out == {"worker": "w1", "revoked": True}
    assert Worker.objects.get(name="w1").revoked_at is not None
    assert "could not send worker.revoked" in caplog.text


# submit_job


def test_submit_job_count_3_queues_three_jobs_in_order():
    ProjectFactory(name="web")

    out = run("submit_job", "--project", "web", "--kind", "build", "--count", "3")

    builds = DerivationBuild.objects.order_by("created_at")
    assert out == {"job_ids": [b.job_key for b in builds]}
    assert [b.status for b in builds] == [BuildStatus.QUEUED] * 3


def test_submit_job_carries_architecture_features_paths_and_priority():
    ProjectFactory(name="web")

    (job_id,) = run(
        "submit_job",
        "--project=web",
        "--kind=eval",
        "--arch=aarch64-linux",
        "--features=kvm+big-parallel",
        "--paths=/nix/store/a+/nix/store/b",
        "--prioritized",
    )["job_ids"]

    evaluation = Evaluation.objects.get()
    assert job_id == f"eval:{evaluation.pk}"
    assert evaluation.status == EvaluationStatus.QUEUED
    assert evaluation.architecture == "aarch64-linux"
    assert evaluation.required_features == ["kvm", "big-parallel"]
    assert evaluation.paths == ["/nix/store/a", "/nix/store/b"]
    assert evaluation.prioritized


def test_a_single_job_defaults_to_one_unprioritized_job_of_the_default_architecture():
    ProjectFactory(name="web")

    run("submit_job", "--project", "web", "--kind", "eval")

    evaluation = Evaluation.objects.get()
    assert (evaluation.architecture, evaluation.required_features, evaluation.prioritized) == (
        "x86_64-linux",
        [],
        False,
    )


# As a real process: exit code, stdout and stderr.


@pytest.mark.django_db(transaction=True)
def test_a_command_run_as_a_process_prints_one_json_object_and_exits_0():
    done = manage("create_project", "web")

    assert (done.returncode, done.stdout, done.stderr) == (0, '{"project": "web"}\n', "")
    assert Project.objects.filter(name="web").exists()


@pytest.mark.django_db(transaction=True)
def test_a_refusal_run_as_a_process_prints_one_line_on_stderr_and_exits_non_zero():
    ProjectFactory(name="web")

    done = manage(
        "submit_cluster", "--project=web", "--member=a:eval:primary", "--member=b:eval:primary"
    )

    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "CommandError: more than one primary member (roles 'a', 'b')"
    ]
    assert not Evaluation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_argument_of_undecodable_bytes_run_as_a_process_is_refused_in_one_line():
    done = manage("create_project", b"web\xc3(")

    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.splitlines() == ["CommandError: argument NAME is not valid UTF-8"]
    assert not Project.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_usage_error_run_as_a_process_is_one_line_too():
    done = manage("submit_cluster", "--project=web", "--project=db", "--member=a:eval")

    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "CommandError: Error: argument --project: given more than once"
    ]
