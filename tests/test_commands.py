"""The operator commands (shared protocol.md, "Operator commands"): one JSON object on stdout,
or a one-line refusal on stderr that leaves every table as it was."""

import asyncio
import json
import logging
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchedOutcome,
    Evaluation,
    EvaluationStatus,
    Project,
)
from gradient.wire.groups import worker_group
from tests.commands import manage
from tests.factories import ProjectFactory, WorkerFactory
from workers.models import Worker, hash_token

ROOT = Path(__file__).resolve().parent.parent
IN_MEMORY_LAYER = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

pytestmark = pytest.mark.django_db


def run(*args) -> dict:
    out = StringIO()
    call_command(*args, stdout=out)
    (line,) = out.getvalue().splitlines()
    return json.loads(line)


def refusal(*args) -> str:
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError) as refused:
        call_command(*args, stdout=out, stderr=err)
    message = str(refused.value)
    assert message and "\n" not in message
    assert (out.getvalue(), err.getvalue()) == ("", "")
    return message


def table_contents() -> dict[str, tuple[int, str]]:
    """Each table's row count and an md5 of its rows (as text, sorted), so a refusal that
    changed a row is caught as well as one that added or removed one."""
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
        cursor.execute(
            " UNION ALL ".join(
                f"SELECT {i}, count(*), md5(coalesce(string_agg(t::text, E'\\n' ORDER BY t::text),"
                f" '')) FROM {connection.ops.quote_name(table)} t"
                for i, table in enumerate(tables)
            )
        )
        return {tables[i]: (count, digest) for i, count, digest in cursor.fetchall()}


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

    def seat(attempt, key, worker, outcome=None):
        DispatchedJob.objects.create(
            kind=key.split(":")[0],
            job_id=key,
            worker=worker,
            project=cluster.project,
            dispatched_at=attempt.created_at,
            finished_at=attempt.finished_at,
            outcome=outcome,
            cluster_attempt=attempt,
        )

    seat(oldest, build_key, w2, DispatchedOutcome.FAILED)
    seat(oldest, eval_key, w1, DispatchedOutcome.ABANDONED)
    seat(newest, eval_key, w2)
    seat(newest, build_key, w1, DispatchedOutcome.COMPLETED)

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
                },
                {
                    "role": "node",
                    "index": 1,
                    "job_id": build_key,
                    "worker": "w2",
                    "outcome": "Failed",
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
                {"role": "node", "index": 0, "job_id": eval_key, "worker": "w2", "outcome": None},
                {
                    "role": "node",
                    "index": 1,
                    "job_id": build_key,
                    "worker": "w1",
                    "outcome": "Completed",
                },
            ],
        },
    ]


# Refusals: every bad argument exits non-zero and writes nothing.


@pytest.fixture
def world():
    """A project, a live worker, a revoked worker, a worker without access to the project and
    a cluster, so "nothing written" is checked against tables that are not empty."""
    ProjectFactory(name="web")
    WorkerFactory(name="w1")
    WorkerFactory(name="gone", revoked_at=timezone.now())
    WorkerFactory(name="elsewhere", all_projects=False)
    run("submit_cluster", "--project=web", "--member=a:eval", "--member=b:build")


BEYOND_INTEGER = str(2**31)  # one past PostgreSQL's integer
BEYOND_BIGINT = str(2**63)
LONG_NAME = "n" * 201  # project and worker names are varchar(200)
JOB = ["submit_job", "--project=web", "--kind=eval"]
CLUSTER = ["submit_cluster", "--project=web"]


def members(*specs: str) -> list[str]:
    return [*CLUSTER, *(f"--member={spec}" for spec in specs)]


REFUSALS = {
    # create_project
    "a missing project name": (["create_project"], "required: NAME"),
    "an empty project name": (["create_project", ""], "must not be empty"),
    "a second project of one name": (["create_project", "web"], "already exists"),
    "an over-long project name": (["create_project", LONG_NAME], "longer than 200"),
    "a NUL in a project name": (["create_project", "a\x00b"], "NAME contains a NUL byte"),
    "a project name of undecodable bytes": (["create_project", "a\udcc3"], "not valid UTF-8"),
    "an extra argument to create_project": (["create_project", "a", "b"], "unrecognized"),
    # create_worker
    "a missing worker name": (["create_worker"], "required: NAME"),
    "a second worker of one name": (["create_worker", "w1"], "already exists"),
    "an empty worker name": (["create_worker", " "], "must not be empty"),
    "an over-long worker name": (["create_worker", LONG_NAME], "longer than 200"),
    "a NUL in a worker name": (["create_worker", "w\x002"], "NAME contains a NUL byte"),
    "access to an unknown project": (
        ["create_worker", "w2", "--projects", "web,nope"],
        "unknown project(s): 'nope'",
    ),
    "an empty project in --projects": (["create_worker", "w2", "--projects", "web,"], "empty"),
    "an empty --projects": (["create_worker", "w2", "--projects", ""], "empty project name"),
    "a NUL in --projects": (
        ["create_worker", "w2", "--projects", "web\x00"],
        "--projects contains a NUL byte",
    ),
    "a repeated --projects": (
        ["create_worker", "w2", "--projects=web", "--projects=web"],
        "more than once",
    ),
    "revoking an unknown worker": (["create_worker", "ghost", "--revoke"], "unknown worker"),
    "revoking a revoked worker": (["create_worker", "gone", "--revoke"], "already revoked"),
    "revoke with --projects": (["create_worker", "w1", "--revoke", "--projects=web"], "--projects"),
    "a repeated --revoke": (["create_worker", "w1", "--revoke", "--revoke"], "more than once"),
    "an extra argument to create_worker": (["create_worker", "w2", "w3"], "unrecognized"),
    # submit_job
    "a job without --project": (["submit_job", "--kind=eval"], "required: --project"),
    "a job without --kind": (["submit_job", "--project=web"], "required: --kind"),
    "a job in an unknown project": (
        ["submit_job", "--project=nope", "--kind=eval"],
        "unknown project",
    ),
    "a job of an unknown kind": (["submit_job", "--project=web", "--kind=vm"], "invalid choice"),
    "a count of zero": ([*JOB, "--count=0"], "--count must be 1 to 10000, not 0"),
    "a count beyond one submission": ([*JOB, "--count=10001"], "must be 1 to 10000"),
    "a count beyond any integer column": ([*JOB, "--count=99999999999"], "must be 1 to 10000"),
    "a count that is no number": ([*JOB, "--count=x"], "invalid int"),
    "an empty feature": ([*JOB, "--features=a++b"], "empty item"),
    "an over-long architecture": ([*JOB, "--arch=" + "x" * 65], "1 to 64 characters"),
    "a NUL in --arch": ([*JOB, "--arch=x86\x00"], "--arch contains a NUL byte"),
    "a NUL in --paths": ([*JOB, "--paths=/a+/b\x00"], "--paths contains a NUL byte"),
    "a repeated --count": ([*JOB, "--count=1", "--count=2"], "more than once"),
    "a repeated --prioritized": ([*JOB, "--prioritized", "--prioritized"], "more than once"),
    # submit_cluster
    "a cluster without --project": (["submit_cluster", "--member=a:eval"], "required: --project"),
    "a cluster in an unknown project": (
        ["submit_cluster", "--project=nope", "--member=a:eval"],
        "unknown project",
    ),
    "a NUL in --project": (
        ["submit_cluster", "--project=web\x00", "--member=a:eval"],
        "--project contains a NUL byte",
    ),
    "a cluster without --member": (CLUSTER, "at least one --member"),
    "a spec without a kind": (members("a:eval", "b"), "expected ROLE:KIND"),
    "an empty role": (members("a:eval", ":build"), "empty role"),
    "an over-long role": (members("r" * 101 + ":eval"), "role is longer than 100"),
    "a NUL in a role": (members("a:eval", "b\x00:eval"), "--member contains a NUL byte"),
    "an unknown kind": (members("a:eval", "b:vm"), "unknown kind"),
    "an empty spec option": (members("a:eval::primary"), "empty option"),
    "an unknown spec option": (members("a:eval", "b:eval:zone=z"), "unknown option"),
    "a repeated spec option": (members("a:eval:pin=w1:pin=w1"), "pin given more than once"),
    "primary with a value": (members("a:eval:primary=yes"), "primary takes no value"),
    "pin= without a worker": (members("a:eval:pin="), "pin needs a value"),
    "pin without =": (members("a:eval:pin"), "pin needs a value"),
    "an over-long member architecture": (members("a:eval:arch=" + "x" * 65), "1 to 64"),
    "an empty member feature": (members("a:build:features=kvm++big"), "empty item"),
    "a second primary": (members("a:eval:primary", "b:build:primary"), "more than one primary"),
    "a pin naming an unknown worker": (
        members("a:eval:pin=w1", "b:eval:pin=ghost"),
        "unknown worker(s): 'ghost'",
    ),
    "one worker pinned twice": (members("a:eval:pin=w1", "b:build:pin=w1"), "pinned twice"),
    "a pin naming a revoked worker": (members("a:eval:pin=gone"), "revoked worker(s): 'gone'"),
    "a pin naming a worker without access": (
        members("a:eval:pin=elsewhere"),
        "without access to project 'web': 'elsewhere'",
    ),
    "a negative retry budget": (
        [*members("a:eval"), "--retry-budget=-1"],
        "must not be negative",
    ),
    "a retry budget beyond the integer column": (
        [*members("a:eval"), f"--retry-budget={BEYOND_INTEGER}"],
        f"retry budget must be at most 2147483647, not {BEYOND_INTEGER}",
    ),
    "a retry budget that PostgreSQL would store wrapped": (
        [*members("a:eval"), "--retry-budget=99999999999"],
        "at most 2147483647",
    ),
    "a retry budget that is no number": (
        [*members("a:eval"), "--retry-budget=two"],
        "invalid int",
    ),
    "a repeated --retry-budget": (
        [*members("a:eval"), "--retry-budget=1", "--retry-budget=2"],
        "more than once",
    ),
    "a repeated --same-zone": (
        [*members("a:eval"), "--same-zone", "--same-zone"],
        "more than once",
    ),
    "a repeated --prioritized on a cluster": (
        [*members("a:eval"), "--prioritized", "--prioritized"],
        "more than once",
    ),
    "a repeated --project": ([*members("a:eval"), "--project=web"], "more than once"),
    "an extra argument to submit_cluster": ([*members("a:eval"), "extra"], "unrecognized"),
}
# show_cluster, abort_cluster and explain_cluster take one cluster ID alike.
for command in ("show_cluster", "abort_cluster", "explain_cluster"):
    REFUSALS |= {
        f"{command} without an ID": ([command], "required: ID"),
        f"{command} of an unknown cluster": ([command, "999999"], "unknown cluster 999999"),
        f"{command} of an ID beyond bigint": (
            [command, BEYOND_BIGINT],
            f"unknown cluster {BEYOND_BIGINT}",
        ),
        f"{command} of a negative ID": ([command, "--", "-1"], "unknown cluster -1"),
        f"{command} of an ID that is no number": ([command, "abc"], "invalid int value: 'abc'"),
        f"{command} of two IDs": ([command, "1", "2"], "unrecognized"),
    }
REFUSALS |= {
    "an over-long abort reason": (["abort_cluster", "1", "--reason", "r" * 1001], "longer than"),
    "a NUL in an abort reason": (
        ["abort_cluster", "1", "--reason", "stop\x00"],
        "--reason contains a NUL byte",
    ),
}


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(("args", "error"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_bad_argument_is_refused_in_one_line_and_nothing_is_written(args, error):
    before = table_contents()

    assert error in refusal(*args)

    assert table_contents() == before


@pytest.mark.usefixtures("world")
def test_a_changed_row_shows_in_the_table_contents_though_no_count_moved():
    before = table_contents()

    Worker.objects.filter(name="w1").update(zone="elsewhere")

    after = table_contents()
    assert after["worker"] != before["worker"]
    assert after["worker"][0] == before["worker"][0]
    assert {t: c for t, c in after.items() if t != "worker"} == {
        t: c for t, c in before.items() if t != "worker"
    }


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
