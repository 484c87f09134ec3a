"""explain_cluster: why a cluster waits.

Either it is not waiting for seats (not Queued, or kept out of the cluster book), or explain()
says, per member, which connected workers could seat it and why each other cannot, by the
planner's own answers, so this never disagrees with a dispatch pass. When no placement on
distinct workers exists, the members breaking Hall's condition name the workers they compete for.
"""

from collections import Counter
from dataclasses import dataclass
from itertools import combinations

from django.db import connection
from django.utils import timezone

from clusters import planner, reservation
from clusters.book import role_indexes
from clusters.fleet import planned_worker
from clusters.history import iso_utc
from clusters.models import (
    ATTEMPT_IS_OPEN,
    ClusterJob,
    ClusterStatus,
    backing_off,
    backoff_since,
    retry_backoff,
)
from clusters.statements import STARTABLE_SQL
from gradient.jobs.models import DispatchedJob
from workers.health import is_quarantined
from workers.models import Worker, idle_slot_fresh_since

# Up to this many members the blocking set is the smallest one, found by trying every subset.
SUBSETS_UP_TO = 12


def explain(cluster_id: int, now=None, reserved: dict[int, int] | None = None) -> dict:
    """Why the cluster waits. Raises ClusterJob.DoesNotExist for an unknown id."""
    now = now or timezone.now()
    cluster = ClusterJob.objects.get(pk=cluster_id)
    members = list(
        cluster.members.select_related("evaluation", "derivation_build").order_by("role", "id")
    )
    head = {"id": cluster.pk, "status": cluster.status, "same_zone": cluster.same_zone}
    reasons = _kept_out(cluster, members, now)
    if reasons or not _in_book(cluster.pk, now):
        reason = "; ".join(reasons) or "not in the cluster book"
        return {**head, "waiting": False, "reason": reason, "summary": reason}
    if reserved is None:
        reserved = reservation.reserved_workers()
    return {**head, "waiting": True, **_seating(cluster, members, now, reserved)}


# Not in the book: the book's reasons (clusters.statements.STARTABLE_SQL), in its order.


def _kept_out(cluster: ClusterJob, members: list, now) -> list[str]:
    attempts = cluster.attempts_made.order_by("-created_at")
    if cluster.status == ClusterStatus.RUNNING:
        started = attempts.filter(ATTEMPT_IS_OPEN, started_at__isnull=False).first()
        if started is None:
            return ["Running"]
        return [f"Running: attempt {started.pk} started at {iso_utc(started.started_at)}"]
    if cluster.status != ClusterStatus.QUEUED:
        return [cluster.status]
    open_attempt = attempts.filter(ATTEMPT_IS_OPEN).first()
    if open_attempt is not None:
        since = iso_utc(open_attempt.created_at)
        return [f"preparing: attempt {open_attempt.pk} open since {since}"]
    failed = attempts.filter(backing_off(now)).order_by("-finished_at").first()
    if failed is not None:
        until = iso_utc(failed.finished_at + retry_backoff())
        return [f"backing off until {until} after a failed prepare (attempt {failed.pk})"]
    if not members:
        return ["no members"]
    labels = {key: f"{role}/{index}" for key, (role, index) in role_indexes(members).items()}
    out = []
    for m in members:
        job = m.evaluation or m.derivation_build
        if job.status != "Queued":
            out.append(f"member {labels[m.job_key]}'s job {m.job_key} cannot start ({job.status})")
    open_rows = DispatchedJob.objects.filter(
        job_id__in=list(labels), finished_at__isnull=True
    ).select_related("worker")
    for row in open_rows.order_by("job_id"):
        where = "as a single assignment" if row.cluster_attempt_id is None else "in an attempt"
        out.append(f"member {labels[row.job_id]} is open {where} on worker {row.worker.name}")
    return out


def _in_book(cluster_id: int, now) -> bool:
    """Tracking's own query, so explain and the dispatch pass agree on the book."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT 1 FROM ({STARTABLE_SQL}) book WHERE book.id = %(id)s",
            {"backoff": backoff_since(now), "limit": 10_000, "id": cluster_id},
        )
        return cursor.fetchone() is not None


# In the book: seats per member.


def _seating(cluster: ClusterJob, members: list, now, reserved: dict[int, int]) -> dict:
    indexes = role_indexes(members)
    rows = [_member(m, indexes[m.job_key]) for m in members]
    labels = [f"{m.role}/{m.index}" for m in rows]
    workers = _connected(now)
    names = {w.view.id: w.view.name for w in workers}
    # The workers a dispatch pass would plan this cluster over (the views hold live slots only).
    idle = [w.view for w in workers if not w.draining and _free(reserved, w, cluster.pk)]
    seats = [set(ids) for ids in planner.eligible(rows, idle)]
    # worker id -> the first reason it cannot seat the member, None where it can.
    reasons = [
        {w.view.id: _reason(m, w, ids, reserved, cluster.pk) for w in workers}
        for m, ids in zip(rows, seats, strict=True)
    ]

    out: dict = {"members": []}
    if cluster.same_zone:
        zones = planner.zones(w.view for w in workers)
        full = [z for z, ids in zones if planner.match([s & ids for s in seats]) is not None]
        short = [
            {"zone": z, **_shortfall([s & ids for s in seats], labels, names)}
            for z, ids in zones
            if z not in full
        ]
        out["zones"] = {"full": full, "short": short}
        if full:
            # Only zones seating every member count: a seat elsewhere is in another zone.
            inside = set().union(*(ids for z, ids in zones if z in full))
            for by_worker in reasons:
                for w, r in by_worker.items():
                    if r is None and w not in inside:
                        by_worker[w] = "in another zone"
            seats = [s & inside for s in seats]

    for m, by_worker in zip(rows, reasons, strict=True):
        out["members"].append(
            {
                "member": f"{m.role}/{m.index}",
                "role": m.role,
                "index": m.index,
                "job_id": m.key,
                "kind": m.kind,
                "pin": m.pin,
                "candidates": [names[w] for w, r in by_worker.items() if r is None],
                "others": [{"worker": names[w], "reason": r} for w, r in by_worker.items() if r],
            }
        )
    if all(seats) and planner.match(seats) is None:
        out["blocking"] = _blocking(seats, labels, names)
    out["summary"] = _summary(out)
    return out


def _member(m, seat: tuple[str, int]) -> planner.Member:
    job = m.evaluation or m.derivation_build
    return planner.Member(
        key=m.job_key,
        kind=m.kind,
        role=seat[0],
        index=seat[1],
        pin=m.pin,
        architecture=job.architecture,
        features=frozenset(job.required_features),
        project_id=job.project_id,
    )


@dataclass(frozen=True)
class _Connected:
    view: planner.Worker  # as the planner would see it, were it not draining
    slots: frozenset[str]  # kinds with an idle slot, live or not
    stale: frozenset[str]  # kinds whose idle slot is older than the TTL
    draining: bool


def _connected(now) -> list[_Connected]:
    """Every connected worker, by name, with its idle slots."""
    fresh = idle_slot_fresh_since(now)
    out = []
    for w in (
        Worker.objects.filter(channel_name__isnull=False, revoked_at__isnull=True)
        .prefetch_related("idle_slots", "projects")
        .order_by("name")
    ):
        slots = {s.kind: s.recorded_at >= fresh for s in w.idle_slots.all()}
        view = planned_worker(
            w,
            (kind for kind, live in slots.items() if live),
            frozenset(p.pk for p in w.projects.all()),
            quarantined=is_quarantined(w, now),
        )
        stale = frozenset(kind for kind, live in slots.items() if not live)
        out.append(_Connected(view, frozenset(slots), stale, w.draining))
    return out


def _free(reserved: dict[int, int], worker: _Connected, cluster_id: int) -> bool:
    """Not reserved for another cluster: the pass leaves those out of its snapshot."""
    return reserved.get(worker.view.id) in (None, cluster_id)


def _reason(member: planner.Member, worker: _Connected, seats: set[int], reserved, cluster_id):
    """None if the worker can seat the member, else the first reason it cannot (the zone aside)."""
    if worker.view.id in seats:
        return None
    if worker.view.quarantined:
        return planner.QUARANTINED
    if member.kind not in worker.slots:
        return "no idle slot of that kind"
    if member.kind in worker.stale:
        return "idle slot stale"
    if worker.draining:
        return "draining"
    reason = planner.seat_reason(member, worker.view)
    if reason is None and not _free(reserved, worker, cluster_id):
        return "reserved for another cluster"
    return reason


# Members on distinct workers: Hall's condition when there is no such seating.


def _violating(seats: list[set[int]]) -> list[int]:
    """Members S whose seats together number fewer than |S| (Hall), among members without a
    seating: the smallest such set for a handful of members, else one none of them can leave."""
    if len(seats) <= SUBSETS_UP_TO:
        for size in range(1, len(seats) + 1):
            for subset in combinations(range(len(seats)), size):
                if len(set().union(*(seats[i] for i in subset))) < size:
                    return list(subset)
    # Leave out each member without whom the rest still has no seating. What is kept then has
    # none, but would without any one of its members: by Hall, its seats number fewer than it.
    kept = list(range(len(seats)))
    for member in range(len(seats)):
        rest = [i for i in kept if i != member]
        if planner.match([seats[i] for i in rest]) is None:
            kept = rest
    return kept


def _blocking(seats, labels, names) -> dict:
    subset = _violating(seats)
    workers = sorted(names[w] for w in set().union(*(seats[i] for i in subset)))
    text = f"{len(subset)} members compete for {len(workers)} workers"
    if len(workers) == 1:
        text = f"{len(subset)} members compete for 1 worker"
    return {"members": [labels[i] for i in subset], "workers": workers, "text": text}


def _shortfall(seats, labels, names) -> dict:
    """What keeps one zone from seating every member."""
    unseated = [labels[i] for i, s in enumerate(seats) if not s]
    if unseated:
        return {"members": unseated, "text": "no seat for " + ", ".join(unseated)}
    return _blocking(seats, labels, names)


def _summary(out: dict) -> str:
    unseated = [m for m in out["members"] if not m["candidates"]]
    if unseated:
        # Every member sees every connected worker, as a candidate or with a reason.
        first = out["members"][0]
        if not first["candidates"] and not first["others"]:
            return "Waiting: no worker is connected."
        parts = []
        for m in unseated:
            counts = Counter(o["reason"] for o in m["others"])
            why = ", ".join(f"{reason}: {n}" for reason, n in counts.most_common())
            parts.append(f"{m['member']} ({why})")
        return "Waiting: no worker can seat " + "; ".join(parts) + "."
    if "blocking" in out:
        b = out["blocking"]
        return (
            f"Waiting: {b['text']}: {', '.join(b['members'])} can only sit on "
            f"{', '.join(b['workers'])}."
        )
    zones = out.get("zones")
    if zones is not None and not zones["full"]:
        parts = [f"{_zone(z['zone'])}: {z['text']}" for z in zones["short"]]
        return "Waiting: no single zone can seat every member (" + "; ".join(parts) + ")."
    where = f" in {', '.join(map(_zone, zones['full']))}" if zones else ""
    return (
        f"Not blocked: every member has a seat{where}; the next dispatch pass should start it "
        "unless a cluster ahead of it in the book takes those workers first."
    )


def _zone(zone: str | None) -> str:
    return "the zoneless workers" if zone is None else f"zone {zone}"
