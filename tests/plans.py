"""What a call's statement read, from its plan run again under EXPLAIN ANALYZE."""

from django.db import connection
from django.test.utils import CaptureQueriesContext


def scans(call, tables, statement: int = -1):
    """The scans of these tables in the plan of one of the call's statements (the last by
    default): (node, rows read, kept or filtered out, over all its loops)."""
    with CaptureQueriesContext(connection) as captured:
        call()
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + captured.captured_queries[statement]["sql"]
        )
        [[root]] = cursor.fetchone()
    nodes = [root["Plan"]]
    while nodes:
        node = nodes.pop()
        nodes += node.get("Plans", ())
        if node.get("Relation Name") in tables:
            rows = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            yield node, rows * node["Actual Loops"]


def rows_read(call, tables, statement: int = -1) -> dict[str, int]:
    """The rows of each of these tables that one of the call's statements read, by table. An
    index probed in a loop counts a row per probe at least: EXPLAIN gives rows per loop,
    rounded down to none where most probes find nothing."""
    read: dict[str, int] = {}
    for node, rows in scans(call, tables, statement):
        probes = node["Actual Loops"] if "Index Name" in node else 0
        table = node["Relation Name"]
        read[table] = read.get(table, 0) + max(rows, probes)
    return read


def clusters_with_history(project, queued: int, finished: int) -> list:
    """`queued` clusters waiting to start and `finished` Completed ones behind them, each of
    two evaluations (role server) and a build (role client) in the same state, as on a busy
    server that keeps its history: the queued ones first."""
    from django.utils import timezone

    from clusters.models import ClusterJob, ClusterMember
    from gradient.jobs.models import DerivationBuild, Evaluation

    now = timezone.now()
    clusters = ClusterJob.objects.bulk_create(
        ClusterJob(project=project, status=status, waiting_since=now if live else None)
        for live, status in [(True, "Queued")] * queued + [(False, "Completed")] * finished
    )
    twice = [c for c in clusters for _ in range(2)]
    evaluations = Evaluation.objects.bulk_create(
        Evaluation(project=project, status=c.status) for c in twice
    )
    builds = DerivationBuild.objects.bulk_create(
        DerivationBuild(project=project, status=c.status) for c in clusters
    )
    ClusterMember.objects.bulk_create(
        [
            ClusterMember(cluster_job=c, evaluation=e, role="server")
            for c, e in zip(twice, evaluations, strict=True)
        ]
        + [
            ClusterMember(cluster_job=c, derivation_build=b, role="client")
            for c, b in zip(clusters, builds, strict=True)
        ]
    )
    return clusters
