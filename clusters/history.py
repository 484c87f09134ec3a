"""One cluster as show_cluster (and the admin) presents it: its members, and its attempts oldest
first with the seat each member took."""

from datetime import UTC, datetime

from clusters.book import role_indexes
from clusters.models import ClusterJob
from gradient.jobs.models import DispatchedJob


def describe_cluster(cluster: ClusterJob) -> dict:
    """show_cluster's object for `cluster`, in three queries whatever its size."""
    members = list(cluster.members.order_by("role", "id"))
    seat_of = role_indexes(members)

    attempts = list(cluster.attempts_made.order_by("created_at", "id"))
    seats: dict = {attempt.pk: [] for attempt in attempts}
    rows = DispatchedJob.objects.filter(cluster_attempt__in=list(seats)).values(
        "id", "cluster_attempt_id", "job_id", "worker__name", "outcome"
    )
    for row in rows:
        role, index = seat_of.get(row["job_id"], (None, None))
        seats[row["cluster_attempt_id"]].append(
            {
                "role": role,
                "index": index,
                "job_id": row["job_id"],
                "worker": row["worker__name"],
                "outcome": row["outcome"],
                "assignment_id": str(row["id"]),  # show_log's argument
            }
        )
    for attempt_seats in seats.values():
        attempt_seats.sort(key=roster_order)

    return {
        "id": cluster.pk,
        "status": cluster.status,
        "same_zone": cluster.same_zone,
        "attempts": cluster.attempts,
        "retry_budget": cluster.retry_budget,
        "members": [
            {"role": m.role, "job_id": m.job_key, "primary": m.primary, "pin": m.pin}
            for m in members
        ],
        "history": [
            {
                "id": str(attempt.pk),
                "outcome": attempt.outcome,
                "created_at": iso_utc(attempt.created_at),
                "started_at": iso_utc(attempt.started_at),
                "finished_at": iso_utc(attempt.finished_at),
                "seats": seats[attempt.pk],
            }
            for attempt in attempts
        ],
    }


def roster_order(seat: dict) -> tuple:
    """A seat's place in the roster; one whose member is gone (its job collected) goes last."""
    return (seat["role"] is None, seat["role"] or "", seat["index"] or 0)


def iso_utc(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
