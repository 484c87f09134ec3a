"""The admin's lists of rows kept for the whole history count what they show without reading
every row: an unfiltered list of a large table by PostgreSQL's estimate, a filtered one exactly
and without the columns' subqueries."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from clusters.models import AttemptOutcome, ClusterStatus
from gradient.jobs import admin as jobs_admin
from tests.admin_rows import CLUSTERS, attempt
from tests.factories import ClusterFactory, EvalMemberFactory

pytestmark = pytest.mark.django_db


def three_clusters():
    made = [ClusterFactory(status=ClusterStatus.COMPLETED) for _ in range(2)]
    made.append(ClusterFactory(status=ClusterStatus.QUEUED))
    for cluster in made:
        EvalMemberFactory(cluster_job=cluster)
        attempt(cluster, AttemptOutcome.SUCCEEDED, minutes_ago=1)
    return made


def test_a_large_unfiltered_list_shows_the_estimate(admin_client, analyzed, monkeypatch):
    three_clusters()
    analyzed()
    monkeypatch.setattr(jobs_admin, "ESTIMATE_ABOVE", 2)
    response = admin_client.get(CLUSTERS)
    assert response.context["cl"].paginator.estimated
    assert response.context["cl"].result_count == 3
    assert "about 3 cluster jobs" in response.content.decode()


def test_a_small_table_is_counted_exactly(admin_client, analyzed):
    three_clusters()
    analyzed()
    response = admin_client.get(CLUSTERS)
    assert not response.context["cl"].paginator.estimated
    text = response.content.decode()
    assert "3 cluster jobs" in text and "about 3" not in text


def test_a_filtered_list_is_counted_exactly_without_the_columns_subqueries(
    admin_client, analyzed, monkeypatch
):
    three_clusters()
    analyzed()
    monkeypatch.setattr(jobs_admin, "ESTIMATE_ABOVE", 2)
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(CLUSTERS, {"status__exact": "Completed"})
    cl = response.context["cl"]
    assert (cl.result_count, cl.paginator.estimated) == (2, False)
    assert {c.num_members for c in cl.result_list} == {1}
    [count] = [q["sql"] for q in queries.captured_queries if "__count" in q["sql"]]
    assert "cluster_attempt" not in count and "cluster_member" not in count
