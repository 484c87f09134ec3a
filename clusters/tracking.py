"""The spec's Tracking: which jobs are cluster members, and which clusters can start.

Members of a Queued cluster start only as members (through the dispatch pass); members of a
Running cluster wait for it. The single path never sees them: each job row's active_member
says whether it is a member of a Queued or Running cluster, kept by triggers on cluster_member
and cluster_job (migration 0005), whoever writes them.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from django.db import connection
from django.utils import timezone

from clusters import planner
from clusters.models import (
    ATTEMPT_IS_OPEN_SQL,
    BACKING_OFF_SQL,
    ClusterStatus,
    backoff_since,
    no_open_attempt_sql,
)
from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from gradient.postgresql.arrays import int_array
from gradient.wire.keys import job_key_sql, member_key_sql
from workers.head import FEATURES_SQL, access_sql, job_table, literals, offerable, window
from workers.health import quarantined_sql
from workers.models import idle_slot_fresh_since


@dataclass(frozen=True)
class MemberRow:
    """A member of a cluster that can start, with what its seat and its AssignJob need."""

    cluster_id: int
    key: str
    kind: str
    job: uuid.UUID
    role: str
    index: int
    pin: str | None
    architecture: str
    features: tuple[str, ...]
    project_id: int
    project: str
    substitute: bool  # a build's cache_available as seen now: its claim gate
    paths: tuple[str, ...] = ()  # what a JobOffer of it names

    def planned(self) -> planner.Member:
        return planner.Member(
            key=self.key,
            kind=self.kind,
            role=self.role,
            index=self.index,
            pin=self.pin,
            architecture=self.architecture,
            features=frozenset(self.features),
            project_id=self.project_id,
        )


@dataclass(frozen=True)
class StartableCluster:
    id: int
    same_zone: bool
    prioritized: bool
    created_at: datetime
    members: tuple[MemberRow, ...]
    waiting_since: datetime | None = None
    offered_at: datetime | None = None  # when the pass offered it to the idle seats


def planned_cluster(cluster: StartableCluster, avoid: frozenset[int] = frozenset()):
    return planner.Cluster(
        id=cluster.id,
        same_zone=cluster.same_zone,
        members=tuple(m.planned() for m in cluster.members),
        avoid=avoid,
    )


def planned_worker(
    w, idle_kinds, projects: frozenset[int] | None, *, quarantined: bool = False
) -> planner.Worker:
    """A Worker row as the planner sees it; `projects` None when it may access every one."""
    return planner.Worker(
        id=w.pk,
        name=w.name,
        zone=w.zone,
        idle_kinds=frozenset(idle_kinds),
        architectures=frozenset(w.architectures),
        features=frozenset(w.system_features),
        projects=None if w.all_projects else projects,
        can_eval=w.can_eval,
        can_build=w.can_build,
        quarantined=quarantined,
    )


class WorkerRow(NamedTuple):
    """A connected worker as FLEET_SQL reads it, with the names planned_worker reads."""

    pk: int
    name: str
    zone: str | None
    architectures: list[str]
    system_features: list[str]
    all_projects: bool
    can_eval: bool
    can_build: bool
    kinds: list[str]  # its live idle slots' kinds, none for a busy worker
    quarantined: bool


# The connected workers that may be seated (but for the `reserved` ones), each with the kinds
# of its live idle slots: those with one at least ({join} JOIN), as the dispatch pass plans
# over, or every one (LEFT JOIN), as a reservation's target is planned over.
FLEET_SQL = """
SELECT w.id, w.name, w.zone, w.architectures, w.system_features, w.all_projects,
       w.can_eval, w.can_build,
       coalesce(array_agg(s.kind) FILTER (WHERE s.kind IS NOT NULL), '{{}}'), {quarantined}
FROM worker w
{join} JOIN idle_slot s ON s.worker_id = w.id AND s.recorded_at >= %(fresh)s
WHERE w.channel_name IS NOT NULL AND NOT w.draining AND w.revoked_at IS NULL
  AND w.id <> ALL(%(reserved)s::bigint[])
GROUP BY w.id
ORDER BY w.id
"""


def fleet(now, *, idle_only: bool, reserved=()) -> tuple[list[WorkerRow], dict[int, frozenset]]:
    """FLEET_SQL's rows, and the projects of each worker limited to some: plain rows in two
    statements, whatever the fleet's size (not a model instance per worker)."""
    sql = FLEET_SQL.format(join="" if idle_only else "LEFT", quarantined=quarantined_sql("w"))
    access: dict[int, set[int]] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            sql, {"fresh": idle_slot_fresh_since(now), "reserved": int_array(reserved), "now": now}
        )
        rows = [WorkerRow._make(row) for row in cursor.fetchall()]
        limited = [w.pk for w in rows if not w.all_projects]
        if limited:
            cursor.execute(
                "SELECT worker_id, project_id FROM worker_projects"
                " WHERE worker_id = ANY(%s::bigint[])",
                [int_array(limited)],
            )
            for worker_id, project_id in cursor.fetchall():
                access.setdefault(worker_id, set()).add(project_id)
    return rows, {pk: frozenset(projects) for pk, projects in access.items()}


# The same numbering in SQL, over cluster_member's rows of one cluster.
ROLE_INDEX_SQL = "row_number() OVER (PARTITION BY role ORDER BY id) - 1"


def role_indexes(members) -> dict[str, tuple[str, int]]:
    """job key -> (role, index): members of one role count from 0 in creation (id) order."""
    seen: dict[str, int] = {}
    out = {}
    for m in sorted(members, key=lambda m: (m.role, m.id)):
        seen[m.role] = seen.get(m.role, -1) + 1
        out[m.job_key] = (m.role, seen[m.role])
    return out


# Clusters that can start: Queued, no open attempt, not backing off after a failed prepare,
# and every member's job startable (evaluation Queued, build Queued) with no open row
# anywhere. A member that cannot start holds its whole cluster back. Each cluster's attempts
# and members are aggregated in subqueries of their own, which PostgreSQL cannot flatten:
# joined flat, it hash-joined every attempt and job row of the history kept for each pass.
STARTABLE_SQL = f"""
SELECT c.id, c.same_zone, c.created_at, c.prioritized, c.waiting_since, c.offered_at
FROM cluster_job c
CROSS JOIN LATERAL (
    SELECT count(*) AS blocking FROM cluster_attempt a
    WHERE a.cluster_job_id = c.id
      AND ({ATTEMPT_IS_OPEN_SQL}
           OR ({BACKING_OFF_SQL}))
) t
CROSS JOIN LATERAL (
    SELECT bool_and(coalesce(e.status = '{EvaluationStatus.QUEUED}',
                             b.status = '{BuildStatus.QUEUED}')) AS queued,
           bool_or(EXISTS (
               SELECT 1 FROM dispatched_job d WHERE d.finished_at IS NULL AND d.job_id =
                   {member_key_sql("m.evaluation_id", "m.derivation_build_id")})) AS open
    FROM cluster_member m
    LEFT JOIN evaluation e ON e.id = m.evaluation_id
    LEFT JOIN derivation_build b ON b.id = m.derivation_build_id
    WHERE m.cluster_job_id = c.id
) s
WHERE c.status = '{ClusterStatus.QUEUED}' AND t.blocking = 0 AND s.queued AND NOT s.open
ORDER BY c.prioritized DESC, c.created_at ASC, c.id ASC
LIMIT %(limit)s
"""


# The members of the clusters that can start, with what their seats and AssignJobs need, in
# the order the ORM would give them (ClusterMember.Meta.ordering). Each job row is a subquery
# of its own (its LIMIT keeps it so), probed by its key: joined flat, PostgreSQL hash-joined
# the job tables' whole history for each pass.
MEMBERS_SQL = f"""
SELECT m.cluster_job_id, m.id, m.role, m.pin, m.evaluation_id, m.derivation_build_id,
       coalesce(e.architecture, b.architecture), coalesce(e.required_features, b.required_features),
       p.id, p.name, coalesce(b.cache_available, false), coalesce(e.paths, b.paths),
       {member_key_sql("m.evaluation_id", "m.derivation_build_id")}
FROM cluster_member m
LEFT JOIN LATERAL (
    SELECT e.architecture, e.required_features, e.project_id, e.paths FROM evaluation e
    WHERE e.id = m.evaluation_id LIMIT 1
) e ON true
LEFT JOIN LATERAL (
    SELECT b.architecture, b.required_features, b.project_id, b.cache_available, b.paths
    FROM derivation_build b WHERE b.id = m.derivation_build_id LIMIT 1
) b ON true
JOIN project p ON p.id = coalesce(e.project_id, b.project_id)
WHERE m.cluster_job_id = ANY(%s)
ORDER BY m.cluster_job_id, m.role, m.id
"""


class _Member(NamedTuple):
    """One row of MEMBERS_SQL, named: what role_indexes reads (role, id, job_key) and more."""

    cluster_job_id: int
    id: int
    role: str
    pin: str | None
    evaluation_id: uuid.UUID | None
    derivation_build_id: uuid.UUID | None
    architecture: str
    required_features: list[str]
    project_id: int
    project: str
    cache_available: bool
    paths: list[str]
    job_key: str  # made by PostgreSQL, which formats the uuids cheaper than Python


def startable_clusters(now=None, limit=10_000) -> list[StartableCluster]:
    """The cluster book: every cluster that can start, prioritized first, then the oldest,
    with its members, in two queries (plain rows, no model instances: a pass may read
    thousands)."""
    now = now or timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(STARTABLE_SQL, {"backoff": backoff_since(now), "limit": limit})
        heads = cursor.fetchall()
        if not heads:
            return []
        cursor.execute(MEMBERS_SQL, [[h[0] for h in heads]])
        members = [_Member._make(row) for row in cursor.fetchall()]
    by_cluster: dict[int, list[_Member]] = {}
    for m in members:
        by_cluster.setdefault(m.cluster_job_id, []).append(m)
    out = []
    for cluster_id, same_zone, created_at, prioritized, waiting_since, offered_at in heads:
        rows = by_cluster.get(cluster_id, [])
        indexes = role_indexes(rows)
        out.append(
            StartableCluster(
                id=cluster_id,
                same_zone=same_zone,
                prioritized=prioritized,
                created_at=created_at,
                members=tuple(_member_row(m, indexes[m.job_key]) for m in rows),
                waiting_since=waiting_since,
                offered_at=offered_at,
            )
        )
    return out


# The aging clock of every cluster as one pass saw it: started for the clusters in its book
# it did not place (unless running), stopped for the rest (placed, claimed, or no longer able
# to start). Rows another transaction holds are skipped, not waited for: the next pass
# catches up. Clusters past the book's limit count as not waiting.
NOTE_WAITING_SQL = f"""
WITH changed AS (
    SELECT c.id, c.id = ANY(%(waiting)s::bigint[]) AS waiting FROM cluster_job c
    WHERE (c.waiting_since IS NULL AND c.id = ANY(%(waiting)s::bigint[])
           AND c.status = '{ClusterStatus.QUEUED}')
       OR (c.waiting_since IS NOT NULL AND c.id <> ALL(%(waiting)s::bigint[]))
    FOR NO KEY UPDATE OF c SKIP LOCKED
)
UPDATE cluster_job c SET waiting_since = CASE WHEN changed.waiting THEN %(now)s::timestamptz END
FROM changed WHERE c.id = changed.id
"""


def note_waiting(waiting: list[int], now) -> None:
    """Start the clocks of these clusters (able to start, unplaced) where not running, and
    stop every other one: one statement, whatever the number of clusters."""
    with connection.cursor() as cursor:
        cursor.execute(NOTE_WAITING_SQL, {"waiting": int_array(waiting), "now": now})


def _member_row(m: _Member, seat: tuple[str, int]) -> MemberRow:
    is_eval = m.evaluation_id is not None
    return MemberRow(
        cluster_id=m.cluster_job_id,
        key=m.job_key,
        kind=JobKind.EVAL if is_eval else JobKind.BUILD,
        job=m.evaluation_id if is_eval else m.derivation_build_id,
        role=seat[0],
        index=seat[1],
        pin=m.pin,
        architecture=m.architecture,
        features=tuple(m.required_features),
        project_id=m.project_id,
        project=m.project,
        substitute=bool(m.cache_available),
        paths=tuple(m.paths),
    )


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
