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

from clusters import planner, statements
from clusters.models import backoff_since
from gradient.jobs.models import JobKind


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


def role_indexes(members) -> dict[str, tuple[str, int]]:
    """job key -> (role, index): members of one role count from 0 in creation (id) order."""
    seen: dict[str, int] = {}
    out = {}
    for m in sorted(members, key=lambda m: (m.role, m.id)):
        seen[m.role] = seen.get(m.role, -1) + 1
        out[m.job_key] = (m.role, seen[m.role])
    return out


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
        cursor.execute(statements.STARTABLE_SQL, {"backoff": backoff_since(now), "limit": limit})
        heads = cursor.fetchall()
        if not heads:
            return []
        cursor.execute(statements.BOOK_MEMBERS_SQL, [[h[0] for h in heads]])
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
