"""No SQL outside the state machines' modules spells a status: statements elsewhere take
statuses as parameters or from the enums' constants (gradient.jobs.states)."""

import re
from pathlib import Path

from tests.test_transitions import (
    ATTEMPT_STATES,
    BUILD_STATES,
    CLUSTER_STATES,
    DISPATCHED_STATES,
    EVALUATION_STATES,
)

# Where a status may be spelled in SQL: the machines' own modules (and migrations, which are
# history). Everywhere else SQL gets statuses as parameters or from the machines' constants.
ROOT = Path(__file__).resolve().parent.parent
STATE_MACHINE_MODULES = {"gradient/jobs/models.py", "clusters/models.py", "gradient/jobs/states.py"}
ALL_STATES = EVALUATION_STATES | BUILD_STATES | CLUSTER_STATES | ATTEMPT_STATES | DISPATCHED_STATES
SQL_LITERAL = re.compile("'(" + "|".join(sorted(ALL_STATES)) + ")'")


def test_no_sql_outside_the_state_machines_spells_a_status():
    """Python strings here are double-quoted (ruff format), so a single-quoted status is an
    SQL literal."""
    found = []
    for package in ("clusters", "workers", "gradient"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "/migrations/" in relative or relative in STATE_MACHINE_MODULES:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if SQL_LITERAL.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


def test_the_literal_finder_can_fail():
    assert SQL_LITERAL.search("WHERE c.status = 'Queued'")
    assert not SQL_LITERAL.search('if job.status != "Queued":')
