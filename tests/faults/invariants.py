"""The fault suite's invariant checker: the database's rows (clusters, member jobs, attempts,
dispatched rows, workers) and the fleet's JSON-lines event logs in, a list of violations out
(empty: all is well).

    I1  never two open rows for one job key (nor, in the rows' history, two open at once)
    I2  no worker ever holding two members of one attempt (seated twice, or holding twice)
    I3  no StartCluster for an attempt that did not start (and no start without every
        member's acceptance)
    I4  every attempt closed in time: an unstarted one within the prepare timeout plus one
        pass (time the passes could not run, an outage, does not count); a started one as its
        cluster stops (never open beside a cluster that is not Running), and soon after its
        last member reported or its worker went away
    I5  no member job lost: each is settled (its cluster finished), queued (its cluster
        waits), or held by its cluster's open attempt

`check` is a plain function of plain rows, so its unit tests feed it hand-made ones;
`load_snapshot` and `read_events` read the real ones.
"""

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

EVAL_SETTLED = frozenset({"Completed", "Failed", "Aborted"})
BUILD_SETTLED = frozenset(
    {"Completed", "FailedPermanent", "Aborted", "DependencyFailed", "Substituted"}
)
EVAL_RUNNING = frozenset({"EvaluatingFlake", "EvaluatingDerivation", "Building"})
CLUSTER_TERMINAL = frozenset({"Completed", "Failed", "Aborted"})
START_CLOCK_TOLERANCE = timedelta(seconds=0.1)


@dataclass(frozen=True)
class Limits:
    prepare_timeout: float  # GRADIENT_CLUSTER_PREPARE_TIMEOUT_SECS
    pass_interval: float  # GRADIENT_CLUSTER_DISPATCH_INTERVAL_SECS
    slack: float = 2.0  # a pass's own duration, a loaded machine's scheduling
    recovery_interval: float = 30.0  # the recovery sweep's period (beat schedule)
    touch_every: float = 6.0  # how stale a live worker's last_seen_at may be

    @property
    def prepare(self) -> timedelta:
        return timedelta(seconds=self.prepare_timeout + self.pass_interval + self.slack)


@dataclass(frozen=True)
class Cluster:
    id: int
    status: str


@dataclass(frozen=True)
class Member:
    cluster: int
    job_id: str  # eval:<uuid> or build:<uuid>
    status: str  # its evaluation's or build's status


@dataclass(frozen=True)
class Attempt:
    id: str
    cluster: int
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    outcome: str | None = None


@dataclass(frozen=True)
class Row:
    """A dispatched_job row, its worker by name."""

    id: str
    job_id: str
    worker: str
    dispatched_at: datetime
    attempt: str | None = None
    finished_at: datetime | None = None
    outcome: str | None = None
    accepted_at: datetime | None = None


@dataclass(frozen=True)
class Worker:
    name: str
    connected: bool
    last_seen_at: datetime | None


@dataclass
class Snapshot:
    taken_at: datetime
    clusters: Sequence[Cluster] = ()
    members: Sequence[Member] = ()
    attempts: Sequence[Attempt] = ()
    rows: Sequence[Row] = ()
    workers: Sequence[Worker] = field(default_factory=tuple)


Outage = tuple[datetime, datetime]


def check(
    snapshot: Snapshot,
    events: Iterable[dict],
    limits: Limits,
    outages: Sequence[Outage] = (),
) -> list[str]:
    events = list(events)
    return [
        *one_open_row_per_job(snapshot),
        *one_member_per_worker(snapshot, events),
        *starts_only_started_attempts(snapshot, events),
        *attempts_closed_in_time(snapshot, limits, outages),
        *no_member_job_lost(snapshot),
    ]


# I1


def one_open_row_per_job(s: Snapshot) -> list[str]:
    out = []
    by_job: dict[str, list[Row]] = defaultdict(list)
    for row in s.rows:
        by_job[row.job_id].append(row)
    for job_id, rows in by_job.items():
        open_rows = [r for r in rows if r.finished_at is None]
        if len(open_rows) > 1:
            out.append(f"I1 {job_id} has {len(open_rows)} open rows: {[r.id for r in open_rows]}")
        rows.sort(key=lambda r: r.dispatched_at)
        for a, b in itertools.pairwise(rows):
            if a.finished_at is None or a.finished_at > b.dispatched_at:
                out.append(
                    f"I1 {job_id}: row {a.id} (open until {a.finished_at}) overlaps row {b.id}"
                    f" dispatched at {b.dispatched_at}"
                )
    return out


# I2


def one_member_per_worker(s: Snapshot, events: list[dict]) -> list[str]:
    out = []
    seated = Counter((r.attempt, r.worker) for r in s.rows if r.attempt is not None)
    for (attempt, worker), n in sorted(seated.items()):
        if n > 1:
            out.append(f"I2 attempt {attempt} seats worker {worker} {n} times")
    held: dict[tuple[str, str], set[str]] = defaultdict(set)
    for e in events:
        if e.get("event") == "held" and e.get("attempt"):
            held[(e["worker"], e["attempt"])].add(e.get("job_id"))
    for (worker, attempt), jobs in sorted(held.items()):
        if len(jobs) > 1:
            out.append(f"I2 worker {worker} held {len(jobs)} members of attempt {attempt}")
    return out


# I3


def starts_only_started_attempts(s: Snapshot, events: list[dict]) -> list[str]:
    out = []
    attempts = {a.id: a for a in s.attempts}
    seats: dict[str, list[Row]] = defaultdict(list)
    for r in s.rows:
        if r.attempt is not None:
            seats[r.attempt].append(r)
    for e in events:
        if e.get("event") not in ("started", "start_ignored") or not e.get("attempt"):
            continue
        who = f"{e['worker']} got StartCluster for attempt {e['attempt']}"
        a = attempts.get(e["attempt"])
        if a is None:
            out.append(f"I3 {who}, which does not exist")
        elif a.started_at is None:
            out.append(f"I3 {who}, which never started ({a.outcome or 'open'})")
        elif parse_time(e["time"]) < a.started_at - START_CLOCK_TOLERANCE:
            out.append(f"I3 {who} at {e['time']}, before it started at {a.started_at}")
        elif e["event"] == "started" and e["worker"] not in {r.worker for r in seats[a.id]}:
            out.append(f"I3 {who}, where it has no seat")
    for a in s.attempts:
        if a.started_at is None:
            continue
        if a.outcome == "PrepareFailed":
            out.append(f"I3 attempt {a.id} started but closed PrepareFailed")
        if not seats[a.id]:
            out.append(f"I3 attempt {a.id} started with no member")
        for r in seats[a.id]:
            if r.accepted_at is None or r.accepted_at > a.started_at:
                out.append(
                    f"I3 attempt {a.id} started at {a.started_at} before {r.job_id} on"
                    f" {r.worker} accepted ({r.accepted_at})"
                )
    return out


# I4


def attempts_closed_in_time(
    s: Snapshot, limits: Limits, outages: Sequence[Outage] = ()
) -> list[str]:
    out = []
    status = {c.id: c.status for c in s.clusters}
    rows: dict[str, list[Row]] = defaultdict(list)
    for r in s.rows:
        if r.attempt is not None:
            rows[r.attempt].append(r)
    workers = {w.name: w for w in s.workers}
    open_by_cluster: dict[int, list[Attempt]] = defaultdict(list)
    for a in s.attempts:
        if a.finished_at is None:
            open_by_cluster[a.cluster].append(a)
        if a.started_at is None:
            end = a.finished_at or s.taken_at
            allowed = limits.prepare + downtime(outages, a.created_at, end)
            if end - a.created_at > allowed:
                state = "still open" if a.finished_at is None else f"closed {a.outcome}"
                out.append(
                    f"I4 attempt {a.id} of cluster {a.cluster} prepared for"
                    f" {secs(end - a.created_at)}, {state} (limit {secs(allowed)})"
                )
        if a.finished_at is not None:
            continue
        cluster = status.get(a.cluster)
        expected = "Queued" if a.started_at is None else "Running"
        if cluster != expected:
            out.append(f"I4 attempt {a.id} is open while its cluster {a.cluster} is {cluster}")
        if a.started_at is None:
            continue
        seated = rows[a.id]
        if seated and all(r.finished_at is not None for r in seated):
            last = max(r.finished_at for r in seated)
            if s.taken_at - last > timedelta(seconds=limits.slack) + downtime(
                outages, last, s.taken_at
            ):
                out.append(f"I4 attempt {a.id}: every member reported by {last}, still open")
        gone_for = timedelta(
            seconds=limits.recovery_interval
            + limits.pass_interval
            + limits.touch_every
            + limits.slack
        )
        for r in seated:
            w = workers.get(r.worker)
            if r.finished_at is None and w is not None and not w.connected:
                seen = w.last_seen_at
                if seen is None or s.taken_at - seen > gone_for + downtime(
                    outages, seen, s.taken_at
                ):
                    out.append(
                        f"I4 attempt {a.id}: {r.job_id}'s worker {r.worker} is gone"
                        f" (last seen {seen}), the attempt still open"
                    )
    for c in s.clusters:
        opened = open_by_cluster.get(c.id, [])
        if c.status == "Running" and not any(a.started_at is not None for a in opened):
            out.append(f"I4 cluster {c.id} is Running without a started open attempt")
    return out


def downtime(outages: Sequence[Outage], start: datetime, end: datetime) -> timedelta:
    total = timedelta()
    for a, b in outages:
        lo, hi = max(a, start), min(b, end)
        if hi > lo:
            total += hi - lo
    return total


# I5


def no_member_job_lost(s: Snapshot) -> list[str]:
    out = []
    status = {c.id: c.status for c in s.clusters}
    open_attempt = {a.cluster: a for a in s.attempts if a.finished_at is None}
    seated: dict[str, set[str]] = defaultdict(set)  # attempt -> job keys with a row in it
    open_row: dict[str, Row] = {}
    for r in s.rows:
        if r.attempt is not None:
            seated[r.attempt].add(r.job_id)
        if r.finished_at is None:
            open_row[r.job_id] = r
    for m in s.members:
        cluster = status.get(m.cluster)
        is_eval = m.job_id.startswith("eval:")
        settled = EVAL_SETTLED if is_eval else BUILD_SETTLED
        attempt = open_attempt.get(m.cluster)
        where = f"I5 member {m.job_id} ({m.status}) of {cluster} cluster {m.cluster}"
        if cluster in CLUSTER_TERMINAL:
            if m.status not in settled:
                out.append(f"{where} is not settled")
            elif m.job_id in open_row:
                out.append(f"{where} still has an open row {open_row[m.job_id].id}")
        elif cluster == "Queued" and attempt is None:
            if m.status != "Queued":
                out.append(f"{where} is not queued")
            elif m.job_id in open_row:
                out.append(f"{where} has an open row {open_row[m.job_id].id} outside any attempt")
        elif cluster == "Queued":  # preparing: claimed into the open attempt, not started
            # Claimed builds took their Assigned transition; evaluations move at the start.
            if m.job_id not in seated[attempt.id]:
                out.append(f"{where} has no seat in the preparing attempt {attempt.id}")
            elif m.status != ("Queued" if is_eval else "Building"):
                out.append(f"{where} is not held by its preparing attempt {attempt.id}")
        elif cluster == "Running":
            running = EVAL_RUNNING if is_eval else {"Building"}
            if attempt is None or m.job_id not in seated[attempt.id]:
                out.append(f"{where} has no seat in its cluster's open attempt")
            elif m.status not in running:
                out.append(f"{where} is not running in attempt {attempt.id}")
        else:
            out.append(f"{where}: unknown cluster")
    return out


# Reading the real rows and logs


SNAPSHOT_SQL = {
    "clusters": "SELECT id, status FROM cluster_job",
    "members": """
        SELECT m.cluster_job_id,
               CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
                    ELSE 'build:' || m.derivation_build_id::text END,
               coalesce(e.status, b.status)
        FROM cluster_member m
        LEFT JOIN evaluation e ON e.id = m.evaluation_id
        LEFT JOIN derivation_build b ON b.id = m.derivation_build_id""",
    "attempts": """
        SELECT id::text, cluster_job_id, created_at, started_at, finished_at, outcome
        FROM cluster_attempt""",
    "rows": """
        SELECT d.id::text, d.job_id, w.name, d.dispatched_at, d.cluster_attempt_id::text,
               d.finished_at, d.outcome, d.accepted_at
        FROM dispatched_job d JOIN worker w ON w.id = d.worker_id""",
    "workers": "SELECT name, channel_name IS NOT NULL, last_seen_at FROM worker",
}
KINDS = {"clusters": Cluster, "members": Member, "attempts": Attempt, "rows": Row}
KINDS["workers"] = Worker


def load_snapshot(conn) -> Snapshot:
    """Every table the checker reads, as of one moment (a repeatable-read transaction), from
    a psycopg connection."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        taken_at = conn.execute("SELECT now()").fetchone()[0]
        parts = {
            name: [KINDS[name](*row) for row in conn.execute(sql).fetchall()]
            for name, sql in SNAPSHOT_SQL.items()
        }
    return Snapshot(taken_at=taken_at, **parts)


def read_events(paths: Iterable[Path]) -> list[dict]:
    """The fleet's events; a line cut short by a SIGKILL is skipped."""
    events = []
    for path in paths:
        if not Path(path).exists():
            continue
        for line in Path(path).read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event and "worker" in event:
                events.append(event)
    return events


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value)


def secs(delta: timedelta) -> str:
    return f"{delta.total_seconds():.1f}s"
