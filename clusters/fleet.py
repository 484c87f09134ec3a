"""The fleet as a pass plans over it: the connected workers that may be seated, with the
kinds of their live idle slots and the projects they may access."""

from typing import NamedTuple

from django.db import connection

from clusters import planner, statements
from gradient.postgresql.arrays import int_array
from workers.models import idle_slot_fresh_since
from workers.statements import quarantined_sql


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


def fleet(now, *, idle_only: bool, reserved=()) -> tuple[list[WorkerRow], dict[int, frozenset]]:
    """FLEET_SQL's rows, and the projects of each worker limited to some: plain rows in two
    statements, whatever the fleet's size (not a model instance per worker)."""
    sql = statements.FLEET_SQL.format(
        join="" if idle_only else "LEFT", quarantined=quarantined_sql("w")
    )
    access: dict[int, set[int]] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            sql, {"fresh": idle_slot_fresh_since(now), "reserved": int_array(reserved), "now": now}
        )
        rows = [WorkerRow._make(row) for row in cursor.fetchall()]
        limited = [w.pk for w in rows if not w.all_projects]
        if limited:
            cursor.execute(statements.WORKER_PROJECTS_SQL, [int_array(limited)])
            for worker_id, project_id in cursor.fetchall():
                access.setdefault(worker_id, set()).add(project_id)
    return rows, {pk: frozenset(projects) for pk, projects in access.items()}
