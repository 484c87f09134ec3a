"""An accepted assignment, and how its run ended."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

HOLD_TIMED_OUT = "cluster start timed out"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a run ended: completed, or failed with a protocol kind (transient, permanent,
    timeout, aborted, ...) and an error; `log_tail` is the end of its output, if it had any."""

    completed: bool
    kind: str | None = None
    error: str | None = None
    elapsed_ms: int = 0
    log_tail: str | None = None


@dataclass(eq=False, slots=True)
class Job:
    """An accepted assignment: held (a cluster member before StartCluster) or running."""

    job_id: str
    assignment_id: str
    kind: str
    attempt: str | None = None
    role: str | None = None
    index: int | None = None
    spec: Any = None  # the AssignJob's job (gradient.wire.protocol.JobSpec)
    running: bool = False
    roster: list[dict] | None = None
    started_at: float = 0.0
    timer: asyncio.TimerHandle | None = None  # hold expiry
    task: asyncio.Task | None = None  # the run
    abort_error: str | None = None  # set when the server (or the worker) aborts the run
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    process: Any = None  # what the run is, for a worker that runs processes

    def ids(self) -> dict:
        return {"job_id": self.job_id, "assignment_id": self.assignment_id, "attempt": self.attempt}

    def member(self) -> dict | None:
        """{role, index} for a cluster member, None for a single job."""
        return None if self.attempt is None else {"role": self.role, "index": self.index}
