"""Guarded state transitions of evaluations and shared builds.

A transition is a conditional UPDATE: it moves a job only from a state that allows the move,
and reports whether it did. No caller writes a status directly.
"""

from django.db import models

from gradient.jobs.models import (
    BUILD_REQUEUEABLE,
    EVALUATION_STARTABLE,
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationStatus,
)

E = EvaluationStatus
B = BuildStatus

# target -> states it may be reached from
EVALUATION_SOURCES: dict[str, frozenset[str]] = {
    E.QUEUED: frozenset({E.FETCHING, E.EVALUATING_FLAKE, E.EVALUATING_DERIVATION}),
    E.FETCHING: frozenset({E.QUEUED}),
    E.EVALUATING_FLAKE: frozenset({E.QUEUED, E.FETCHING}),
    E.EVALUATING_DERIVATION: frozenset({E.EVALUATING_FLAKE}),
    E.BUILDING: frozenset({E.EVALUATING_DERIVATION}),
    E.COMPLETED: frozenset({E.EVALUATING_FLAKE, E.EVALUATING_DERIVATION, E.BUILDING}),
    E.FAILED: EVALUATION_STARTABLE,
    E.ABORTED: EVALUATION_STARTABLE,
}

BUILD_SOURCES: dict[str, frozenset[str]] = {
    # From Building: an assignment released before its build ran (prepare failed, retry).
    B.QUEUED: frozenset({B.CREATED, B.BUILDING}) | BUILD_REQUEUEABLE,
    # The Assigned transition: a claimed build is on a worker.
    B.BUILDING: frozenset({B.QUEUED}),
    B.COMPLETED: frozenset({B.BUILDING}),
    B.SUBSTITUTED: frozenset({B.QUEUED, B.BUILDING}),
    B.FAILED_TRANSIENT: frozenset({B.BUILDING}),
    B.FAILED_TIMEOUT: frozenset({B.BUILDING}),
    B.FAILED_PERMANENT: frozenset({B.BUILDING}) | BUILD_REQUEUEABLE,
    B.DEPENDENCY_FAILED: frozenset({B.CREATED, B.QUEUED}),
    B.ABORTED: frozenset({B.CREATED, B.QUEUED, B.BUILDING}) | BUILD_REQUEUEABLE,
}


class IllegalTransition(ValueError):
    pass


def _allowed(model: type[models.Model], sources: dict, to: str, expect) -> frozenset[str]:
    if to not in sources:
        raise IllegalTransition(f"{model.__name__} cannot be moved to {to}")
    allowed = sources[to] if expect is None else sources[to] & frozenset(expect)
    if not allowed:
        raise IllegalTransition(f"{model.__name__} cannot move from {set(expect)} to {to}")
    return allowed


def _advance(model: type[models.Model], sources: dict, pk, to: str, expect=None) -> bool:
    allowed = _allowed(model, sources, to, expect)
    return model.objects.filter(pk=pk, status__in=allowed).update(status=to) == 1


def advance_builds(pks, to: str, expect=None) -> int:
    """Move every listed build that may move to `to`; returns how many moved."""
    allowed = _allowed(DerivationBuild, BUILD_SOURCES, to, expect)
    return DerivationBuild.objects.filter(pk__in=pks, status__in=allowed).update(status=to)


def advance_evaluation(pk, to: str, expect=None) -> bool:
    """Move an evaluation to `to` if its state allows; `expect` narrows the accepted sources."""
    return _advance(Evaluation, EVALUATION_SOURCES, pk, to, expect)


def advance_build(pk, to: str, expect=None) -> bool:
    """Move a shared build to `to` if its state allows; `expect` narrows the accepted sources."""
    return _advance(DerivationBuild, BUILD_SOURCES, pk, to, expect)


def advance_evaluations(pks, to: str, expect=None) -> int:
    """Move every listed evaluation that may move to `to`; returns how many moved."""
    allowed = _allowed(Evaluation, EVALUATION_SOURCES, to, expect)
    return Evaluation.objects.filter(pk__in=pks, status__in=allowed).update(status=to)
