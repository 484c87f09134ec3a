"""What an operator submits as one job, shared by submit_job and the cluster members of
submit_cluster (clusters.submission)."""

from dataclasses import dataclass

from django.db import connection

from gradient.jobs.models import (
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationStatus,
    JobKind,
    Project,
)

ARCH_LIMIT = Evaluation._meta.get_field("architecture").max_length
FEATURE_LIMIT = Evaluation._meta.get_field("required_features").base_field.max_length


def column_range(model, field: str) -> tuple[int, int]:
    """The values an integer column holds. Django binds an IntegerField's value as a binary
    int4 (server-side binding), so PostgreSQL would store a larger one wrapped, not refuse it."""
    return connection.ops.integer_field_range(model._meta.get_field(field).get_internal_type())


class SubmissionError(ValueError):
    """A submission refused before anything is written; the message is one line."""


@dataclass(frozen=True)
class JobSpec:
    kind: str
    architecture: str | None = None  # None: the model's default
    required_features: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    prioritized: bool = False

    def __post_init__(self):
        if self.kind not in JobKind.values:
            raise SubmissionError(f"unknown kind {self.kind!r} (expected eval or build)")
        if self.architecture is not None and not 0 < len(self.architecture) <= ARCH_LIMIT:
            raise SubmissionError(f"architecture must be 1 to {ARCH_LIMIT} characters")
        if any(len(f) > FEATURE_LIMIT for f in self.required_features):
            raise SubmissionError(f"a feature is longer than {FEATURE_LIMIT} characters")


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
