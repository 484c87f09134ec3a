"""Each job row's active_member (the triggers in clusters.models): true exactly while the job is a
member of a Queued or Running cluster, whatever writes cluster_member or cluster_job (raw SQL
here, as the triggers must not depend on the code that writes), and the single path reads it."""

import pgtrigger
import pytest
from django.db import connection

from clusters.submission import MemberSpec, submit_cluster
from gradient.jobs.models import JobKind
from gradient.jobs.submission import JobSpec
from tests.factories import BuildFactory, ProjectFactory, WorkerFactory
from workers import assignment

pytestmark = pytest.mark.django_db

# The definition the flag stands for: membership of a Queued or Running cluster.
TRUTH = """
SELECT j.id::text, j.active_member,
       EXISTS (SELECT 1 FROM cluster_member m JOIN cluster_job c ON c.id = m.cluster_job_id
               WHERE m.{column} = j.id AND c.status IN ('Queued', 'Running'))
FROM {table} j
"""


def flags() -> dict[str, bool]:
    """Every job's flag, after checking that each equals its definition."""
    out = {}
    with connection.cursor() as cursor:
        for table, column in (
            ("evaluation", "evaluation_id"),
            ("derivation_build", "derivation_build_id"),
        ):
            cursor.execute(TRUTH.format(table=table, column=column))
            for job, flag, truth in cursor.fetchall():
                assert flag == truth, (table, job)
                out[job] = flag
    return out


def sql(statement: str, *params) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def submitted(kinds=("eval", "build")):
    ProjectFactory(name="p")
    cluster, members = submit_cluster(
        "p", [MemberSpec(role="node", job=JobSpec(kind=kind)) for kind in kinds]
    )
    jobs = [str(m.evaluation_id or m.derivation_build_id) for m in members]
    return cluster, members, jobs


def test_members_of_a_submitted_cluster_are_flagged_and_other_jobs_are_not():
    _, _, jobs = submitted()
    single = BuildFactory()
    state = flags()
    assert [state[job] for job in jobs] == [True, True]
    assert state[str(single.pk)] is False


@pytest.mark.parametrize("finished", ["Completed", "Failed", "Aborted"])
def test_the_flags_follow_the_clusters_status(finished):
    cluster, _, jobs = submitted()
    sql("UPDATE cluster_job SET status = 'Running' WHERE id = %s", cluster.pk)
    assert all(flags()[job] for job in jobs)
    sql("UPDATE cluster_job SET status = %s WHERE id = %s", finished, cluster.pk)
    assert not any(flags()[job] for job in jobs)
    sql("UPDATE cluster_job SET status = 'Queued' WHERE id = %s", cluster.pk)
    assert all(flags()[job] for job in jobs)


def test_a_member_row_deleted_or_moved_takes_its_flag_along():
    cluster, members, jobs = submitted()
    other, _, _ = submitted(kinds=("build",))
    sql("UPDATE cluster_job SET status = 'Failed' WHERE id = %s", other.pk)
    sql("UPDATE cluster_member SET cluster_job_id = %s WHERE id = %s", other.pk, members[0].pk)
    assert flags()[jobs[0]] is False
    sql("UPDATE cluster_member SET cluster_job_id = %s WHERE id = %s", cluster.pk, members[0].pk)
    assert flags()[jobs[0]] is True
    sql("DELETE FROM cluster_member WHERE id = %s", members[1].pk)
    assert flags()[jobs[1]] is False


def test_a_deleted_cluster_leaves_its_jobs_unflagged():
    cluster, _, jobs = submitted()
    sql("DELETE FROM cluster_job WHERE id = %s", cluster.pk)
    assert not any(flags()[job] for job in jobs)


def test_the_single_path_gives_out_a_member_only_once_its_cluster_has_finished():
    cluster, members, _ = submitted(kinds=("build",))
    worker = WorkerFactory()
    assert assignment.request_job(worker.pk, JobKind.BUILD).assign is None
    sql("UPDATE cluster_job SET status = 'Failed' WHERE id = %s", cluster.pk)
    given = assignment.request_job(worker.pk, JobKind.BUILD).assign
    assert given is not None and given.message.job.build == str(members[0].derivation_build_id)


def test_every_trigger_is_declared_on_a_model():
    """The database's triggers are the models' (pgtrigger), installed as declared: none made
    by hand in a migration alone, none out of date."""
    declared = {trigger.get_pgid(model) for model, trigger in pgtrigger.registered()}
    assert declared
    with connection.cursor() as cursor:
        cursor.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")
        assert {name for (name,) in cursor.fetchall()} == declared
    for model, trigger in pgtrigger.registered():
        assert trigger.get_installation_status(model)[0] == "INSTALLED", trigger.name
