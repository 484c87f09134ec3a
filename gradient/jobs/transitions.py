"""The guarded writes of every state machine (gradient.jobs.states): move(), and the ORM-free
wrappers the single path and the reports call. No caller writes a status, an outcome or a
finish time otherwise; set-based statements take the same write as a CTE.
"""

from collections.abc import Iterable
from datetime import datetime

from django.db import connection
from django.utils import timezone

from gradient.jobs import statements
from gradient.jobs.models import BUILD_MACHINE, DISPATCHED_MACHINE, EVALUATION_MACHINE
from gradient.jobs.states import StateMachine


def move(machine: StateMachine, pks: Iterable, to: str, expect=None, *, at=None) -> int:
    """Move every listed row that may move to `to` (from `expect` only, when given), at
    `at` (now by default) where the move writes a time; how many moved."""
    params = {"ids": list(pks), **machine.bind("move", to, expect, at=at or timezone.now())}
    if not params["ids"]:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(machine.update("move", "id = ANY(%(ids)s)", to=to), params)
        return cursor.rowcount


def advance_evaluation(pk, to: str, expect=None) -> bool:
    """Move an evaluation to `to` if its state allows; `expect` narrows the accepted sources."""
    return move(EVALUATION_MACHINE, [pk], to, expect) == 1


def advance_evaluations(pks, to: str, expect=None) -> int:
    """Move every listed evaluation that may move to `to`; returns how many moved."""
    return move(EVALUATION_MACHINE, pks, to, expect)


def advance_build(pk, to: str, expect=None) -> bool:
    """Move a shared build to `to` if its state allows; `expect` narrows the accepted sources."""
    return move(BUILD_MACHINE, [pk], to, expect) == 1


def advance_builds(pks, to: str, expect=None) -> int:
    """Move every listed build that may move to `to`; returns how many moved."""
    return move(BUILD_MACHINE, pks, to, expect)


def finish_assignments(
    pks,
    outcome: str,
    now: datetime | None = None,
    failure_kind=None,
    *,
    error: str | None = None,
    log_tail: str | None = None,
) -> int:
    """End every listed open assignment with its outcome and its report's output; how many."""
    params = {
        "ids": list(pks),
        "failure_kind": failure_kind,
        "error": error,
        "log_tail": log_tail,
        **DISPATCHED_MACHINE.bind("finish", outcome, at=now or timezone.now()),
    }
    if not params["ids"]:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(statements.FINISH_ASSIGNMENTS_SQL, params)
        return cursor.rowcount
