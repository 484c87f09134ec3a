"""What a cluster's admin page shows: its members with what each runs, every attempt as a bar
on one time axis with the seats it took and how each ended (its outcome, a JobFailed's kind
and error, the end of its output), and while the cluster waits, why (clusters.explain). Pure
but for overview(), which reads the cluster's rows."""

import shlex
from datetime import datetime, timedelta

from django.db.models import Case, Q, When
from django.urls import reverse
from django.utils import timezone

from clusters.book import role_indexes
from clusters.explain import explain
from clusters.history import roster_order
from clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterStatus,
)
from gradient.jobs.models import DispatchedJob, DispatchedOutcome

OPEN = "open"  # an attempt (or seat) not finished yet
# One colour per attempt outcome; used as SVG fill attributes, so no inline style is needed.
OUTCOME_COLOURS = {
    AttemptOutcome.SUCCEEDED: "#2e9d4f",
    AttemptOutcome.FAILED: "#d0413c",
    AttemptOutcome.PREPARE_FAILED: "#f0a01e",
    AttemptOutcome.ABORTED: "#8b8f94",
    OPEN: "#2f7ed8",
}
SEAT_COLOURS = {
    DispatchedOutcome.COMPLETED: OUTCOME_COLOURS[AttemptOutcome.SUCCEEDED],
    DispatchedOutcome.FAILED: OUTCOME_COLOURS[AttemptOutcome.FAILED],
    DispatchedOutcome.ABANDONED: OUTCOME_COLOURS[AttemptOutcome.ABORTED],
}
# The newest attempts drawn on the page; the attempt list has every one.
MAX_BARS = 50
# A bar is drawn at least this wide (percent of the axis), so an instant attempt stays visible.
MIN_BAR_WIDTH = 0.4
TICKS = 4  # intervals of the axis: labels at 0, 25, 50, 75 and 100 %
# Workers named per reason in "why it waits"; the rest are counted.
NAMES_PER_REASON = 8
# The attempts, newest first, whose seats show their log tails; an older seat's is a link, so
# that a page of many attempts stays small.
LOG_ATTEMPTS = 5


# The timeline: pure, from attempts (anything with the four fields) and the time it is now.


def timeline(attempts, now: datetime) -> dict | None:
    """Bars on one shared axis, from the first attempt's creation to the last finish (or now,
    while an attempt is open). Positions are percentages of the axis; None without attempts."""
    attempts = list(attempts)
    if not attempts:
        return None
    start = min(a.created_at for a in attempts)
    end = max(max(a.finished_at or now, a.created_at) for a in attempts)
    span = (end - start).total_seconds() or 1.0  # one instant: any width will do

    def at(moment: datetime) -> float:
        return round(min(max((moment - start).total_seconds() / span, 0.0), 1.0) * 100, 3)

    bars = []
    for a in attempts:
        state = a.outcome or OPEN
        left, right = at(a.created_at), at(a.finished_at or now)
        width = round(max(right - left, 0.0), 3)
        # Preparing from creation to the start; running from the start to the finish.
        started = None if a.started_at is None else min(max(at(a.started_at), left), left + width)
        draw_width = max(width, MIN_BAR_WIDTH)
        bars.append(
            {
                "attempt": a,
                "state": state,
                "label": outcome_label(state),
                "colour": OUTCOME_COLOURS.get(state, OUTCOME_COLOURS[OPEN]),
                "open": a.finished_at is None,
                "left": left,
                "width": width,
                "started": started,  # where the running part begins, None if it never started
                "run_width": None if started is None else round(left + width - started, 3),
                "draw_left": min(left, round(100 - draw_width, 3)),
                "draw_width": draw_width,
                "prepare_for": None if a.started_at is None else a.started_at - a.created_at,
                "ran_for": None if a.started_at is None else (a.finished_at or now) - a.started_at,
                "lasted": (a.finished_at or now) - a.created_at,
            }
        )
    fmt = _tick_format(end - start)
    ticks = []
    for i in range(TICKS + 1):
        moment = timezone.localtime(start + (end - start) * i / TICKS)
        anchor = "start" if i == 0 else "end" if i == TICKS else "middle"
        ticks.append(
            {"at": round(100 * i / TICKS, 3), "label": moment.strftime(fmt), "anchor": anchor}
        )
    return {
        "start": start,
        "end": end,
        "to_now": any(b["open"] for b in bars),
        "ticks": ticks,
        "bars": bars,
    }


def outcome_label(state: str) -> str:
    """As the admin shows the outcome field ("Prepare Failed"); "open" while unfinished."""
    return AttemptOutcome(state).label if state in AttemptOutcome.values else state


def _tick_format(span: timedelta) -> str:
    if span >= timedelta(days=2):
        return "%b %d %H:%M"
    if span >= timedelta(minutes=10):
        return "%H:%M"
    return "%H:%M:%S"


def duration(delta: timedelta | None) -> str:
    """3s, 4m 02s, 1h 05m, 2d 3h."""
    if delta is None:
        return ""
    seconds = max(int(delta.total_seconds()), 0)
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    if days:
        return f"{days}d {h}h"
    if hours:
        return f"{hours}h {m:02d}m"
    if minutes:
        return f"{minutes}m {s:02d}s"
    return f"{s}s"


# The cluster page's context: a handful of queries whatever the cluster's size.


def overview(cluster: ClusterJob, now: datetime | None = None) -> dict:
    now = now or timezone.now()
    members = list(
        cluster.members.select_related("evaluation", "derivation_build").order_by("role", "id")
    )
    seat_of = role_indexes(members)
    total = cluster.attempts_made.count()
    attempts = list(cluster.attempts_made.order_by("-created_at", "-id")[:MAX_BARS])[::-1]
    line = timeline(attempts, now)
    if line is not None:
        _add_seats(line, seat_of)
        for number, bar in enumerate(line["bars"], start=total - len(attempts) + 1):
            bar["number"] = number
            bar["url"] = reverse("admin:clusters_clusterattempt_change", args=[bar["attempt"].pk])
            bar["times"] = _times(bar)
    out = {
        "members": [_member(m, seat_of[m.job_key]) for m in members],
        "timeline": line,
        "attempt_count": total,
        "attempts_url": reverse("admin:clusters_clusterattempt_changelist")
        + f"?cluster_job={cluster.pk}",
        "legend": [(label, OUTCOME_COLOURS[key]) for key, label in _legend()],
        "explanation": None,
    }
    if cluster.status == ClusterStatus.QUEUED:
        out["explanation"] = _explanation(explain(cluster.pk, now=now))
    return out


def _legend():
    yield from ((o.value, o.label) for o in AttemptOutcome)
    yield OPEN, OPEN


def _member(m, seat: tuple[str, int]) -> dict:
    job = m.evaluation or m.derivation_build
    url = None
    if job is not None:
        name = "evaluation" if m.evaluation_id else "derivationbuild"
        url = reverse(f"admin:jobs_{name}_change", args=[job.pk])
    return {
        **work_shown(job),
        "label": f"{seat[0]}/{seat[1]}",
        "role": m.role,
        "index": seat[1],
        "job_key": m.job_key,
        "kind": m.kind,
        "job_url": url,
        "job_status": getattr(job, "status", None),
        "primary": m.primary,
        "pin": m.pin,
    }


def work_shown(job) -> dict:
    """A member job's work (gradient.jobs.work) as the members' table shows it."""
    if job is None:
        return {"command": None, "env": [], "timeout_secs": None}
    return {
        "command": None if job.command is None else shlex.join(job.command),
        "env": [f"{name}={value}" for name, value in sorted(job.env.items())],
        "timeout_secs": job.timeout_secs,
    }


def _add_seats(line: dict, seat_of: dict[str, tuple[str, int]]) -> None:
    """Each bar's seats, in roster order, with how each ended: one query for every attempt
    drawn, which reads the log tails of the newest LOG_ATTEMPTS alone."""
    by_attempt = {bar["attempt"].pk: bar for bar in line["bars"]}
    for bar in line["bars"]:
        bar["seats"] = []
    with_logs = [bar["attempt"].pk for bar in line["bars"][-LOG_ATTEMPTS:]]
    rows = (
        DispatchedJob.objects.filter(cluster_attempt__in=list(by_attempt))
        .annotate(
            has_log=Q(log_tail__isnull=False),
            shown_log=Case(When(cluster_attempt__in=with_logs, then="log_tail")),
        )
        .values(
            "id",
            "cluster_attempt_id",
            "job_id",
            "worker_id",
            "worker__name",
            "worker__zone",
            "outcome",
            "accepted_at",
            "failure_kind",
            "error",
            "has_log",
            "shown_log",
        )
    )
    for row in rows:
        bar = by_attempt[row["cluster_attempt_id"]]
        role, index = seat_of.get(row["job_id"], (None, None))
        state = row["outcome"] or _open_seat(bar["attempt"], row["accepted_at"])
        log_elsewhere = row["has_log"] and row["shown_log"] is None
        bar["seats"].append(
            {
                "label": row["job_id"] if role is None else f"{role}/{index}",
                "role": role,
                "index": index,
                "job_id": row["job_id"],
                "assignment_id": row["id"],
                "worker": row["worker__name"],
                "worker_url": reverse("admin:workers_worker_change", args=[row["worker_id"]]),
                "zone": row["worker__zone"],
                "state": state,
                "colour": SEAT_COLOURS.get(state, OUTCOME_COLOURS[OPEN]),
                # How it ended: its outcome (state), a JobFailed's kind and error, its output.
                "failure_kind": row["failure_kind"],
                "error": row["error"],
                "log_tail": row["shown_log"],
                "log_url": (
                    reverse("admin:jobs_dispatchedjob_change", args=[row["id"]])
                    if log_elsewhere
                    else None
                ),
            }
        )
    for bar in line["bars"]:
        bar["seats"].sort(key=roster_order)


def _open_seat(attempt: ClusterAttempt, accepted_at) -> str:
    if attempt.started_at is not None:
        return "running"
    return "accepted" if accepted_at is not None else "held"


def _times(bar: dict) -> str:
    a = bar["attempt"]
    parts = [f"created {timezone.localtime(a.created_at):%H:%M:%S}"]
    if bar["prepare_for"] is not None:
        parts.append(f"prepared {duration(bar['prepare_for'])}")
        parts.append(("running " if bar["open"] else "ran ") + duration(bar["ran_for"]))
    else:
        parts.append(("preparing " if bar["open"] else "prepare ") + duration(bar["lasted"]))
    return " · ".join(parts)


def _explanation(out: dict) -> dict:
    """explain()'s answer, with each member's other workers grouped by reason."""
    members = []
    for m in out.get("members", []):
        by_reason: dict[str, list[str]] = {}
        for other in m["others"]:
            by_reason.setdefault(other["reason"], []).append(other["worker"])
        groups = [
            {
                "reason": reason,
                "workers": names[:NAMES_PER_REASON],
                "more": max(len(names) - NAMES_PER_REASON, 0),
                "count": len(names),
            }
            for reason, names in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        ]
        members.append({**m, "groups": groups})
    return {**out, "members": members}
