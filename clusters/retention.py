"""The hourly retention pass (spec: Tables, cluster_member and cluster_attempt ON DELETE CASCADE).

It deletes a finished cluster job past GRADIENT_RETENTION_DAYS (0 disables the pass), or at once
one that evaluation garbage collection left without members; never one with an open attempt.

Each batch is a short transaction that first adds its attempts to the metrics' tally (so a
counter never goes down). The member rows in dispatched_job stay as telemetry for worker health
and /metrics, without their attempt and output. Rows are taken SKIP LOCKED, so a second pass or
a claim holding a cluster is skipped, not waited on.
"""

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from clusters import statements
from clusters.models import CLUSTER_TERMINAL
from gradient import metrics

PASS_LOCK = 0x6772_6164_7265  # advisory lock key of the retention pass
BATCH = 1_000


def try_lock(cursor) -> bool:
    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [PASS_LOCK])
    return cursor.fetchone()[0]


def run_retention(batch: int = BATCH) -> int:
    """Delete the cluster jobs retention allows, batch by batch; how many it deleted."""
    days = settings.GRADIENT["RETENTION_DAYS"]
    if days <= 0:
        return 0
    params = {
        "after": 0,
        "finished": sorted(CLUSTER_TERMINAL),
        "cutoff": timezone.now() - timedelta(days=days),
        "batch": batch,
    }
    deleted = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            if not try_lock(cursor):
                return deleted  # another pass is at it
            cursor.execute(statements.EXPIRED_SQL, params)
            ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return deleted
            metrics.tally_deleted(ids)
            cursor.execute(statements.FORGET_OUTPUT_SQL, [ids])
            cursor.execute("DELETE FROM cluster_job WHERE id = ANY(%s)", [ids])
            deleted += cursor.rowcount
        if len(ids) < batch:
            return deleted
        params["after"] = ids[-1]
