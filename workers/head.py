"""The head of the queue (protocol.md): the jobs a worker is offered, and the single jobs the
single path chooses among.

Per kind, the first GRADIENT_OFFER_WINDOW single jobs the worker could take in the single
path's order (prioritized first, then oldest); the members' part, of the clusters waiting to
start, is clusters.tracking's. Each part walks one index in that order and stops at the
window, so a read costs the window plus the jobs ahead that the worker cannot take, never the
depth of the queue.
"""

from dataclasses import dataclass

from django.conf import settings

from gradient.jobs.models import BuildStatus, EvaluationStatus, JobKind
from workers.models import Worker

FULL_STEPS = ["fetch", "evaluate_flake", "evaluate_derivations"]
FETCH_STEPS = ["fetch"]
FOLLOW_UP_STEPS = ["evaluate_flake", "evaluate_derivations"]
BUILD_STEPS = ["build"]


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


def job_table(kind: str) -> tuple[str, str]:
    """(table, job key prefix) of a kind."""
    return ("derivation_build", "build:") if kind == JobKind.BUILD else ("evaluation", "eval:")


def literals(values) -> str:
    # Statuses come from the enums, never from input; written into the text so that the
    # partial indexes' predicates are provable in a generic (prepared) plan too.
    return ", ".join(f"'{v}'" for v in values)


# What the worker's platform and project access allow of a job row j. PostgreSQL guesses that
# an array containment holds for one row in 200 (it keeps no element statistics while jobs
# need no feature), and would then sort the whole queue rather than walk the index to the
# window; wrapped in coalesce, the test counts as one in two.
PLATFORM_SQL = """
j.architecture = ANY(%(architectures)s)
  AND coalesce(j.required_features <@ %(features)s, false)
  AND (%(all_projects)s OR j.project_id IN (
        SELECT project_id FROM worker_projects WHERE worker_id = %(worker)s))
"""

# The single jobs of one kind at the head for this worker, in the single path's order, along
# the kind's idx-<table>-head: startable, no member of an active cluster, no open assignment.
SINGLES_SQL = (
    """
SELECT j.id, j.status, {substitute} AS substitute, j.project_id, p.name AS project,
       j.architecture, j.required_features, j.paths, j.prioritized, j.created_at, j.passed_over
FROM {table} j
JOIN project p ON p.id = j.project_id
WHERE j.status IN ({statuses}) AND NOT j.active_member
  AND """
    + PLATFORM_SQL
    + """
  AND NOT EXISTS (SELECT 1 FROM dispatched_job d
                  WHERE d.job_id = '{prefix}' || j.id::text AND d.finished_at IS NULL)
ORDER BY j.prioritized DESC, j.created_at ASC
LIMIT %(window)s
"""
)


def platform_params(worker: Worker) -> dict:
    """The parameters of PLATFORM_SQL (and of the head's statements)."""
    return {
        "worker": worker.pk,
        "name": worker.name,
        "architectures": worker.architectures,
        "features": worker.system_features,
        "all_projects": worker.all_projects,
        "window": window(),
    }


def singles_sql(how: Offerable) -> str:
    table, prefix = job_table(how.kind)
    return SINGLES_SQL.format(
        table=table,
        prefix=prefix,
        statuses=literals(how.statuses),
        substitute="j.cache_available" if how.kind == JobKind.BUILD else "false",
    )
