"""The head of the queue (protocol.md): the jobs a worker is offered, and the single jobs the
single path chooses among.

Per kind, the first GRADIENT_OFFER_WINDOW single jobs the worker could take in the single
path's order (prioritized first, then oldest); the members' part, of the clusters waiting to
start, is clusters.head's. Each part walks one index in that order and stops at the
window, so a read costs the window plus the jobs ahead that the worker cannot take, never the
depth of the queue.
"""

import functools
import uuid
from dataclasses import dataclass
from typing import NamedTuple

from django.conf import settings
from django.db import connection

from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from gradient.jobs.steps import BUILD_STEPS, FETCH_STEPS, FOLLOW_UP_STEPS, FULL_STEPS
from gradient.wire.keys import job_key_sql
from workers.models import Worker


def window() -> int:
    return int(settings.GRADIENT["OFFER_WINDOW"])


@dataclass(frozen=True)
class Offerable:
    """How one worker can serve a RequestJob of one kind."""

    kind: str
    statuses: tuple[str, ...]
    steps_for: dict  # job status -> steps

    @property
    def fetch_only(self) -> bool:
        return self.steps_for.get(EvaluationStatus.QUEUED) == FETCH_STEPS


def offerable(worker: Worker, kind: str) -> Offerable | None:
    if kind == JobKind.BUILD:
        if not worker.can_build:
            return None
        return Offerable(kind, (BuildStatus.QUEUED,), {BuildStatus.QUEUED: BUILD_STEPS})
    if worker.can_eval:
        # A fetched evaluation (status Fetching, its fetch-only job done) needs the follow-up.
        return Offerable(
            kind,
            (EvaluationStatus.QUEUED, EvaluationStatus.FETCHING),
            {EvaluationStatus.QUEUED: FULL_STEPS, EvaluationStatus.FETCHING: FOLLOW_UP_STEPS},
        )
    if worker.can_fetch:
        # A fetch-only worker takes the fetch step of a split single evaluation.
        return Offerable(kind, (EvaluationStatus.QUEUED,), {EvaluationStatus.QUEUED: FETCH_STEPS})
    return None


def job_table(kind: str) -> str:
    return "derivation_build" if kind == JobKind.BUILD else "evaluation"


def literals(values) -> str:
    # Statuses come from the enums, never from input; written into the text so that the
    # partial indexes' predicates are provable in a generic (prepared) plan too.
    return ", ".join(f"'{v}'" for v in values)


# What the worker's platform allows of a job row j beyond its architecture. PostgreSQL guesses
# that an array containment rarely holds (it keeps no element statistics while jobs need no
# feature), and would then sort the whole queue rather than walk the index to the window;
# wrapped in coalesce, the test counts as an even chance.
FEATURES_SQL = "coalesce(j.required_features <@ %(features)s, false)"

# The condition of the heads' indexes over every project (gradient.jobs.models.EVERY_PROJECT),
# stated by their walk alone: a walk of one project then cannot take those indexes.
EVERY_PROJECT_SQL = "j.created_at IS NOT NULL"

# The walks of the head: per architecture of the worker's (and, for a worker limited to some
# projects, per project of its), one index range in the single path's order up to the window,
# so that the jobs of other architectures and projects are never read; then the first window
# of them all. ({walk} is one range's rows.) The architectures are a VALUES list of as many
# parameters as the worker has: an unnested array parameter counts as many rows in a prepared
# statement's generic plan, which then looks too dear to use, and PostgreSQL would plan the
# offer afresh at every call (docs/design.md, "The statements stay bounded"). The walk over
# every project states the condition of its index alone (`every_project`), so a walk of one
# project reads its project's index.
ACCESS_SQL = """
SELECT h.* FROM (
    SELECT r.* FROM {architectures} AS a(architecture)
    CROSS JOIN LATERAL ({walk}) r
    WHERE (SELECT all_projects FROM worker WHERE id = %(worker)s)
    UNION ALL
    SELECT r.* FROM worker_projects wp
    CROSS JOIN {architectures} AS a(architecture)
    CROSS JOIN LATERAL ({walk_project}) r
    WHERE wp.worker_id = %(worker)s AND NOT (SELECT all_projects FROM worker WHERE id = %(worker)s)
) h
ORDER BY {order}
LIMIT {window}
"""

# The single jobs of one kind in one range of the head, along idx-<table>-head (or -project):
# startable, no member of an active cluster, no open assignment.
SINGLES_WALK = (
    """
SELECT {key} AS key, '{kind}'::text AS kind, j.id, j.status,
       {substitute} AS substitute, j.project_id, p.name AS project, j.architecture,
       j.required_features, j.paths, j.prioritized, j.passed_over, j.created_at
FROM {table} j
JOIN project p ON p.id = j.project_id
WHERE j.architecture = a.architecture {project}
  AND j.status IN ({statuses}) AND NOT j.active_member AND """
    + FEATURES_SQL
    + """
  AND NOT EXISTS (SELECT 1 FROM dispatched_job d
                  WHERE d.job_id = {key} AND d.finished_at IS NULL)
ORDER BY j.prioritized DESC, j.created_at ASC
LIMIT {window}
"""
)


def access_sql(
    walk: str,
    order: str,
    window: int,
    architectures: int,
    project: str = "j.project_id",
    every_project: str = "",
) -> str:
    """A head part over every range the worker may take from, for a worker of this many
    architectures: `walk` has {project} where the condition on the range's project goes,
    `project` the column it tests; `every_project` is what the walk over every project
    states instead (its index's own condition)."""
    return ACCESS_SQL.format(
        walk=walk.replace("{project}", every_project),
        walk_project=walk.replace("{project}", f"AND {project} = wp.project_id"),
        order=order,
        window=window,
        architectures=_values(architectures),
    )


def _values(n: int) -> str:
    if not n:
        return "(SELECT NULL::text WHERE false)"
    return "(VALUES " + ", ".join(f"(%(arch_{i})s::text)" for i in range(n)) + ")"


class HeadJob(NamedTuple):
    """A single job at the head, as SINGLES_SQL reads it: what the choice, the claim, the
    JobOffer and the AssignJob need."""

    key: str
    kind: str
    id: uuid.UUID
    status: str
    substitute: bool
    project_id: int
    project: str
    architecture: str
    required_features: list[str]
    paths: list[str]
    prioritized: bool
    passed_over: int
    created_at: object  # a datetime, or its ISO text when read as JSON

    def offered(self) -> dict:
        """The job as a JobOffer names it."""
        return {
            "job_id": self.key,
            "kind": self.kind,
            "project": self.project,
            "architecture": self.architecture,
            "required_features": self.required_features,
            "paths": self.paths,
        }


def read_singles(worker: Worker, how: Offerable) -> list[HeadJob]:
    """The single jobs of one kind at this worker's head, in the single path's order."""
    with connection.cursor() as cursor:
        cursor.execute(singles_sql(how, len(worker.architectures)), platform_params(worker))
        return [HeadJob._make(row) for row in cursor.fetchall()]


def platform_params(worker: Worker) -> dict:
    """The parameters of the head's statements."""
    return {
        "worker": worker.pk,
        "name": worker.name,
        **{f"arch_{i}": arch for i, arch in enumerate(worker.architectures)},
        "features": worker.system_features,
    }


def singles_sql(how: Offerable, architectures: int) -> str:
    return _singles_sql(how.kind, how.statuses, window(), architectures)


# The window is written into the text (it is a setting, not an input) so that a prepared
# statement's generic plan knows how far the walk goes: with LIMIT unknown, PostgreSQL
# expects to read a tenth of the index and keeps planning every call afresh instead.
@functools.cache
def _singles_sql(kind: str, statuses: tuple[str, ...], window: int, architectures: int) -> str:
    walk = SINGLES_WALK.format(
        table=job_table(kind),
        key=job_key_sql(kind, "j.id"),
        kind=kind,
        statuses=literals(statuses),
        substitute="j.cache_available" if kind == JobKind.BUILD else "false",
        window=window,
        project="{project}",
    )
    every = f"AND {EVERY_PROJECT_SQL}"
    return access_sql(
        walk, "h.prioritized DESC, h.created_at ASC", window, architectures, every_project=every
    )
