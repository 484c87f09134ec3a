"""The members at the head of the queue (protocol.md): what of the clusters waiting to start a
worker is offered, beside its single jobs (workers.head)."""

from clusters.models import no_open_attempt_sql
from gradient.jobs.models import JobKind
from gradient.wire.keys import job_key_sql
from workers.head import FEATURES_SQL, access_sql, job_table, literals, offerable, window
from workers.health import quarantined_sql

# The members of one kind in one range of the head for a worker (protocol.md): those of the
# clusters waiting to start (note_waiting marks them) along idx-cluster_job-waiting (or its
# per-project twin) in the planner's order, cluster by cluster, up to the window. Each
# cluster's members are a subquery of their own, which its LIMIT keeps PostgreSQL from
# flattening: joined flat, it guessed that few members of waiting clusters are queued (most
# job rows are history) and hash-joined every member and job row. Columns as
# workers.offers' members. (workers.head.access_sql runs one walk per range.)
MEMBER_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, x.project,
       x.architecture, x.required_features::text[] AS required_features, x.paths,
       c.prioritized, c.created_at, c.id AS cluster, x.role, x.member
FROM cluster_job c
CROSS JOIN LATERAL (
    SELECT j.id, p.name AS project, j.architecture, j.required_features, j.paths,
           m.role, m.id AS member
    FROM cluster_member m
    JOIN {table} j ON j.id = m.{member_column}
    JOIN project p ON p.id = j.project_id
    WHERE m.cluster_job_id = c.id AND (m.pin IS NULL OR m.pin = %(name)s)
      AND j.status IN ({queued}) AND j.architecture = a.architecture AND """
    + FEATURES_SQL
    + """
    ORDER BY m.role, m.id
    LIMIT {window}
) x
WHERE c.waiting_since IS NOT NULL {project_of_cluster}
  AND """
    + no_open_attempt_sql("c.id")
    + """
ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC, x.role, x.member
LIMIT {window}
"""
)
# As a part of its own, the members pinned to the worker whatever their place, from
# idx-cluster_member-pin.
PINNED_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, p.name AS project,
       j.architecture, j.required_features::text[] AS required_features, j.paths,
       c.prioritized, c.created_at, c.id AS cluster, m.role, m.id AS member
FROM cluster_member m
JOIN cluster_job c ON c.id = m.cluster_job_id
JOIN {table} j ON j.id = m.{member_column}
JOIN project p ON p.id = j.project_id
WHERE m.pin = %(name)s AND c.waiting_since IS NOT NULL {project_of_cluster}
  AND """
    + no_open_attempt_sql("c.id")
    + """
  AND j.status IN ({queued}) AND j.architecture = a.architecture AND """
    + FEATURES_SQL
    + """
ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC, m.role, m.id
LIMIT {window}
"""
)
MEMBER_ORDER = "h.prioritized DESC, h.created_at ASC, h.cluster ASC, h.role, h.member"
# The part's rows as the offer reads them.
# A quarantined worker seats no member (workers.health), so none is offered to it: read from its
# row, since a quarantine can begin while the session runs.
MEMBER_PART = f"""
SELECT key, kind, project, architecture, required_features, paths FROM ({{part}}) x
WHERE NOT (SELECT {quarantined_sql("w")} FROM worker w WHERE w.id = %(worker)s)
"""


def member_head_parts(worker, kinds=JobKind.values) -> list[str]:
    """The members' parts of each kind's head this worker could seat; a member evaluation
    always runs as one job, so a fetch-only worker has none of that kind."""
    parts = []
    for how in (offerable(worker, kind) for kind in kinds):
        if how is None or how.fetch_only:
            continue
        column = "evaluation_id" if how.kind == JobKind.EVAL else "derivation_build_id"
        for template, job in ((MEMBER_WALK, "x"), (PINNED_WALK, "j")):
            walk = template.format(
                table=job_table(how.kind),
                key=job_key_sql(how.kind, f"{job}.id"),
                kind=how.kind,
                member_column=column,
                queued=literals(how.statuses[:1]),  # a member starts from Queued only
                window=window(),
                project_of_cluster="{project}",
            )
            archs = len(worker.architectures)
            part = access_sql(walk, MEMBER_ORDER, window(), archs, project="c.project_id")
            parts.append(MEMBER_PART.format(part=part))
    return parts
