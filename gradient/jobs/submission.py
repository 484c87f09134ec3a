"""What an operator submits as one job, shared by submit_job and the cluster members of
submit_cluster (clusters.submission)."""

from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationStatus,
    JobKind,
    Project,
)
from gradient.jobs.work import WorkError, check_work

ARCH_LIMIT = Evaluation._meta.get_field("architecture").max_length
FEATURE_LIMIT = Evaluation._meta.get_field("required_features").base_field.max_length


def column_range(model, field: str) -> tuple[int, int]:
    """The values an integer column holds. Django binds an IntegerField's value as a binary
    int4 (server-side binding), so PostgreSQL would store a larger one wrapped, not refuse it."""
    return connection.ops.integer_field_range(model._meta.get_field(field).get_internal_type())


class SubmissionError(ValueError):
    """A submission refused before anything is written, in one line; `field` names what broke the
    rule as a document names it (`members[1].command`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def within(self, outer: str) -> "SubmissionError":
        """The same refusal, its field a part of `outer` (`members[1]`)."""
        return SubmissionError(str(self), f"{outer}.{self.field}" if self.field else outer)

    def line(self) -> str:
        """`field: message`, as a document's refusal is told."""
        return f"{self.field}: {self}" if self.field else str(self)


@dataclass(frozen=True)
class JobSpec:
    """One job as submitted; the fields' names in errors are the cluster document's."""

    kind: str
    architecture: str | None = None  # None: the model's default
    required_features: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    prioritized: bool = False
    # The work (gradient.jobs.work): argv or None, extra environment, seconds or None.
    command: Any = None
    env: Any = field(default_factory=dict)
    timeout_secs: Any = None

    def __post_init__(self):
        if self.kind not in JobKind.values:
            raise SubmissionError(f"unknown kind {self.kind!r} (expected eval or build)", "kind")
        if self.architecture is not None and not 0 < len(self.architecture) <= ARCH_LIMIT:
            raise SubmissionError(f"architecture must be 1 to {ARCH_LIMIT} characters", "arch")
        if any(len(f) > FEATURE_LIMIT for f in self.required_features):
            raise SubmissionError(
                f"a feature is longer than {FEATURE_LIMIT} characters", "features"
            )
        # No worker offers an empty feature, and no store path is empty.
        for items, name in ((self.required_features, "features"), (self.paths, "paths")):
            if "" in items:
                raise SubmissionError(f"item {items.index('')} is empty", name)
        try:
            check_work(self.command, self.env, self.timeout_secs)
        except WorkError as e:
            raise SubmissionError(str(e), e.field) from None


def split_plus(value: str, what: str) -> tuple[str, ...]:
    """`A+B` -> ("A", "B"); "" -> (). An empty item (`A++B`) is refused rather than guessed at."""
    if value == "":
        return ()
    items = tuple(value.split("+"))
    if "" in items:
        raise SubmissionError(f"{what} {value!r} has an empty item")
    return items


def new_job(project: Project, spec: JobSpec) -> Evaluation | DerivationBuild:
    """An unsaved job, Queued: an evaluation, or a shared build created straight into Queued."""
    fields = {
        "project": project,
        "required_features": list(spec.required_features),
        "paths": list(spec.paths),
        "prioritized": spec.prioritized,
        "command": spec.command,
        "env": spec.env,
        "timeout_secs": spec.timeout_secs,
    }
    if spec.architecture is not None:
        fields["architecture"] = spec.architecture
    if spec.kind == JobKind.EVAL:
        return Evaluation(status=EvaluationStatus.QUEUED, **fields)
    return DerivationBuild(status=BuildStatus.QUEUED, **fields)


def create_jobs(project: Project, specs: list[JobSpec]) -> list[Evaluation | DerivationBuild]:
    """Inserts the jobs (two statements at most) and returns them in the order of `specs`."""
    jobs = [new_job(project, spec) for spec in specs]
    for model in (Evaluation, DerivationBuild):
        model.objects.bulk_create([job for job in jobs if isinstance(job, model)])
    return jobs
