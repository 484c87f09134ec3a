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
from workers import statements
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
    walk = statements.SINGLES_WALK.format(
        table=job_table(kind),
        key=job_key_sql(kind, "j.id"),
        kind=kind,
        statuses=literals(statuses),
        substitute="j.cache_available" if kind == JobKind.BUILD else "false",
        window=window,
        project="{project}",
    )
    every = f"AND {statements.EVERY_PROJECT_SQL}"
    return statements.access_sql(
        walk, "h.prioritized DESC, h.created_at ASC", window, architectures, every_project=every
    )
