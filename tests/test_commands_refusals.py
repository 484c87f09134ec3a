"""Every bad argument to an operator command exits non-zero with a one-line refusal and writes
nothing: every table's contents are as they were."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from tests.commands import run
from tests.factories import ProjectFactory, WorkerFactory
from workers.models import Worker

pytestmark = pytest.mark.django_db


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
