"""The rows of the claim statement (gradient.jobs.statements.claim_sql): INSERT ... SELECT ...
WHERE <start condition> ON CONFLICT DO NOTHING, a row per assignment, so idx-dispatched_job-
open-job lets at most one row per job key be open however many processes claim.
"""

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from django.utils import timezone

from gradient.jobs.models import BUILD_STARTABLE, EVALUATION_STARTABLE, JobKind
from gradient.wire.keys import job_key


@dataclass(frozen=True)
class ClaimGate:
    """The start condition of one job. A build must still be Queued in the substitute mode the
    claimer saw; an evaluation must not be finished."""

    kind: str
    job: uuid.UUID
    substitute: bool = False

    @cached_property
    def key(self) -> str:
        # Cached: a batch of claims sorts and matches its members by key several times over.
        return job_key(self.kind, self.job)


@dataclass
class Assignment:
    gate: ClaimGate
    worker_id: int
    project_id: int
    steps: list[str] = field(default_factory=list)
    cluster_attempt_id: uuid.UUID | None = None
    missing_nar_size: int | None = None
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    dispatched_at: datetime | None = None
    # What its job runs, as the claim read it back (CLAIMED_WORK): set once claimed.
    work: dict | None = None


START_PARAMS = {
    "build_startable": sorted(BUILD_STARTABLE),
    "eval_startable": sorted(EVALUATION_STARTABLE),
}


def claim_params(assignments: list[Assignment]) -> dict:
    """The parameters of the claim statement (gradient.jobs.statements.claim_sql)."""
    now = timezone.now().isoformat()
    rows = []
    for a in assignments:
        is_build = a.gate.kind == JobKind.BUILD
        job = str(a.gate.job)
        rows.append(
            {
                "id": a.id.hex,
                "kind": a.gate.kind,
                "job_id": a.gate.key,
                "evaluation_id": None if is_build else job,
                "build_id": job if is_build else None,
                "worker_id": a.worker_id,
                "project_id": a.project_id,
                "steps": ",".join(a.steps),
                "dispatched_at": a.dispatched_at.isoformat() if a.dispatched_at else now,
                "attempt_id": a.cluster_attempt_id.hex if a.cluster_attempt_id else None,
                "size": a.missing_nar_size,
                "substitute": a.gate.substitute,
            }
        )
    return {"claims": json.dumps(rows), **START_PARAMS}
