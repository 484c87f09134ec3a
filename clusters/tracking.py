"""The spec's Tracking: which jobs are cluster members, and which clusters can start.

Members of a Queued cluster start only as members (through the dispatch pass); members of a
Running cluster wait for it. The single path asks here, in SQL, so it never sees them.
"""

from clusters.models import CLUSTER_ACTIVE

_ACTIVE = ", ".join(f"'{s.value}'" for s in sorted(CLUSTER_ACTIVE))


def active_member_sql(job_id_sql: str, kind: str) -> str:
    """A correlated subquery: is the job `job_id_sql` (of `kind`) a member of a Queued or
    Running cluster? `job_id_sql` is a column reference of the caller's query."""
    column = "evaluation_id" if kind == "eval" else "derivation_build_id"
    return (
        "SELECT 1 FROM cluster_member m JOIN cluster_job c ON c.id = m.cluster_job_id"
        f" WHERE m.{column} = {job_id_sql} AND c.status IN ({_ACTIVE})"
    )
