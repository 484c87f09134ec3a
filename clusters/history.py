"""One cluster as show_cluster (and the admin) presents it: its members, and its attempts oldest
first with the seat each member took."""

from datetime import UTC, datetime

from clusters.models import ClusterJob
from gradient.jobs.models import DispatchedJob


def describe_cluster(cluster: ClusterJob) -> dict:
    """show_cluster's object for `cluster`, in three queries whatever its size."""
    members = list(cluster.members.order_by("role", "id"))
    # A seat is named by role and index, members of one role counted from 0 in creation order.
    seat_of: dict[str, tuple[str, int]] = {}
    per_role: dict[str, int] = {}
    for member in members:
        index = per_role[member.role] = per_role.get(member.role, -1) + 1
        seat_of[member.job_key] = (member.role, index)

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
        # Roster order; a row whose member is gone (its job collected) goes last.
        attempt_seats.sort(key=lambda s: (s["role"] is None, s["role"] or "", s["index"] or 0))

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


def iso_utc(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
