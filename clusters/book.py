"""The spec's cluster book: which clusters can start (derived by one query, each pass), with
their members, and which jobs are cluster members.

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
from clusters.models import ATTEMPT_IS_OPEN_SQL, BACKING_OFF_SQL, ClusterStatus, backoff_since
from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from gradient.wire.keys import member_key_sql


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
BOOK_MEMBERS_SQL = f"""
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
    """One row of BOOK_MEMBERS_SQL, named: what role_indexes reads (role, id, job_key) and more."""

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
        cursor.execute(BOOK_MEMBERS_SQL, [[h[0] for h in heads]])
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
