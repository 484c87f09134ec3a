"""One worker as show_worker (and the admin) presents it: its connection, its quarantine and
its recent cluster seats with their blame."""

from django.utils import timezone

from clusters.book import role_indexes
from clusters.history import iso_utc
from clusters.models import ClusterMember
from workers.health import RECENT_SEATS, on_probation, quarantine_of, seat_rows
from workers.models import Worker


def recent_seats(worker_id: int, limit: int = RECENT_SEATS) -> list[dict]:
    """The worker's cluster seats, newest first, named by attempt, cluster and (role, index)."""
    rows = seat_rows(worker_id, limit)
    members: dict[int, list] = {}
    clusters = {row["cluster"] for row in rows}
    for member in ClusterMember.objects.filter(cluster_job_id__in=clusters):
        members.setdefault(member.cluster_job_id, []).append(member)
    seat_of = {cluster: role_indexes(ms) for cluster, ms in members.items()}
    out = []
    for row in rows:
        cluster = row["cluster"]
        role, index = seat_of.get(cluster, {}).get(row["job_id"], (None, None))
        out.append(
            {
                "attempt": str(row["attempt"]),
                "cluster": cluster,
                "role": role,
                "index": index,
                "outcome": row["outcome"],
                "blamed": row["blame"] is not None,
                "blame": row["blame"],
                "dispatched_at": iso_utc(row["dispatched_at"]),
            }
        )
    return out


def describe_worker(worker: Worker, now=None) -> dict:
    """show_worker's object for `worker`."""
    now = now or timezone.now()
    quarantine = quarantine_of(worker, now)
    return {
        "worker": worker.name,
        "connected": worker.connected,
        "zone": worker.zone,
        "draining": worker.draining,
        "quarantined": None
        if quarantine is None
        else {"since": iso_utc(quarantine.since), "reason": quarantine.reason, "by": quarantine.by},
        "probation": on_probation(worker, now),
        "blamed_in_row": worker.blamed_in_row,
        "recent_seats": recent_seats(worker.pk),
    }
