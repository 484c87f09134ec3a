"""Asking the idle seats for their scores (protocol.md, the head of the queue).

A cluster that becomes able to start is offered at once to the idle workers that could seat
its members, and the dispatch pass places it on their answers, or GRADIENT_SCORE_WAIT_MS after
the offers for a worker that has not answered: a cluster that meets an idle fleet is seated by
its scores, not by ties. The offers are job_score rows without a score, as a session's are, so
each pair is offered once per connection whichever process offers it. A pass offers the
clusters of its head only (GRADIENT_OFFER_WINDOW members of a kind, in the planner's order),
each member to at most a window of its idle seats; a new cluster beyond the head waits for a
later pass.
"""

import json
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from itertools import zip_longest

from django.conf import settings
from django.db import connection

from clusters import planner
from clusters.tracking import StartableCluster
from gradient.postgresql.arrays import int_array, text_array
from workers.groups import send_frames
from workers.head import window
from workers.offers import RenderedOffer


def score_wait() -> timedelta:
    return timedelta(milliseconds=settings.GRADIENT["SCORE_WAIT_MS"])


# The members of the clusters offered lately that an idle worker was offered and has not
# scored yet, from idx-job_score-job-size (a row without a size is an unanswered offer).
UNANSWERED_SQL = """
SELECT DISTINCT s.job_id FROM job_score s
WHERE s.job_id = ANY(%(keys)s::text[]) AND s.missing_nar_size IS NULL
  AND s.offered_at > %(since)s AND s.worker_id = ANY(%(idle)s::bigint[])
"""

# The pairs not offered yet on the workers' connections, offered now.
OFFER_SQL = """
WITH fresh AS (
    INSERT INTO job_score (worker_id, job_id, offered_at)
    SELECT p.worker_id, p.job_id, %(now)s
    FROM unnest(%(workers)s::bigint[], %(keys)s::text[]) AS p(worker_id, job_id)
    ON CONFLICT (worker_id, job_id) DO NOTHING
    RETURNING worker_id, job_id
)
SELECT worker_id, array_agg(job_id) FROM fresh GROUP BY worker_id
"""

MARK_SQL = """
UPDATE cluster_job SET offered_at = %(now)s
WHERE id = ANY(%(clusters)s::bigint[]) AND offered_at IS NULL
"""


class Asking:
    """One pass's view of which placements wait for scores: `ready` tells, placement by
    placement in the planner's order, offering the new clusters of the head as it meets them.
    The head holds the clusters that wait for answers, up to a window of members of a kind;
    `due` is when the pass should run again for the clusters it held, None if it held none."""

    def __init__(self, clusters: list[StartableCluster], workers: tuple[planner.Worker, ...], now):
        self.now = now
        self.book = {c.id: c for c in clusters}
        self.workers = workers
        self.alike = alike(workers)
        self.left = Counter({kind: window() for kind in planner.KINDS})
        self.due: datetime | None = None
        self.offered: list[int] = []
        self.unanswered = self._unanswered(clusters, [w.id for w in workers])

    def ready(self, placement: planner.Placement) -> bool:
        cluster = self.book[placement.cluster_id]
        if not score_wait():
            return True  # GRADIENT_SCORE_WAIT_MS=0: placed at once on the scores there are
        if cluster.offered_at is None:
            kinds = Counter(m.kind for m in cluster.members)
            if any(self.left[kind] < n for kind, n in kinds.items()):
                self._hold(self.now)  # offered by a later pass, once the head has room
                return False
            if not self._offer(cluster):
                return True  # every seat has scored it already
            self.left -= kinds
            self._hold(self.now)
            return False
        if any(m.key in self.unanswered for m in cluster.members):
            self.left -= Counter(m.kind for m in cluster.members)
            self._hold(cluster.offered_at)
            return False
        return True

    def finish(self) -> None:
        """Record when the clusters offered by this pass were offered."""
        if self.offered:
            with connection.cursor() as cursor:
                cursor.execute(MARK_SQL, {"now": self.now, "clusters": int_array(self.offered)})

    def _hold(self, offered_at: datetime) -> None:
        due = offered_at + score_wait()
        self.due = due if self.due is None else min(self.due, due)

    def _unanswered(self, clusters: list[StartableCluster], idle: list[int]) -> set[str]:
        since = self.now - score_wait()
        keys = [
            m.key
            for c in clusters
            if c.offered_at is not None and c.offered_at > since
            for m in c.members
        ]
        if not keys or not idle:
            return set()
        with connection.cursor() as cursor:
            cursor.execute(
                UNANSWERED_SQL,
                {"keys": text_array(keys), "since": since, "idle": int_array(idle)},
            )
            return {key for (key,) in cursor.fetchall()}

    def _offer(self, cluster: StartableCluster) -> bool:
        """Offer the cluster's members to every idle worker that could seat them and was not
        offered them yet; whether any was."""
        self.offered.append(cluster.id)
        pairs = [
            (worker.id, member.key)
            for member in cluster.members
            for worker in asked(seats(member.planned(), self.alike))
        ]
        if not pairs:
            return False
        with connection.cursor() as cursor:
            cursor.execute(
                OFFER_SQL,
                {
                    "now": self.now,
                    "workers": int_array(w for w, _ in pairs),
                    "keys": text_array([k for _, k in pairs]),
                },
            )
            fresh = cursor.fetchall()
        if not fresh:
            return False
        items = {m.key: _offered_json(m) for m in cluster.members}
        frames = [
            (worker_id, RenderedOffer("[" + ",".join(items[k] for k in keys) + "]"))
            for worker_id, keys in fresh
        ]
        send_frames(frames, event="worker.offer")
        return True


def alike(workers: tuple[planner.Worker, ...]) -> list[list[planner.Worker]]:
    """The workers grouped by all the planner's eligibility looks at but the name, so that it
    is asked once per group rather than per worker."""
    groups = defaultdict(list)
    for worker in workers:
        groups[_profile(worker)].append(worker)
    return list(groups.values())


def seats(member: planner.Member, groups: list[list[planner.Worker]]) -> list[planner.Worker]:
    """The workers that could seat the member, by the planner's own eligibility."""
    out = []
    for group in groups:
        if member.pin is not None:
            group = [w for w in group if w.name == member.pin]
        if group and planner.seat_reason(member, group[0]) is None:
            out += group
    return out


def asked(workers: list[planner.Worker]) -> list[planner.Worker]:
    """At most a window of a member's seats, taken in turn from each zone: what a start costs
    stays bounded however large an idle fleet, and a same_zone cluster has scored seats in
    every zone to choose among."""
    by_zone = defaultdict(list)
    for worker in sorted(workers, key=lambda w: w.id):
        by_zone[worker.zone].append(worker)
    turns = zip_longest(*by_zone.values())
    return [w for turn in turns for w in turn if w is not None][: window()]


def _profile(worker: planner.Worker) -> tuple:
    return (
        worker.idle_kinds,
        worker.architectures,
        worker.features,
        worker.projects,
        worker.can_eval,
        worker.can_build,
    )


def _offered_json(member) -> str:
    return json.dumps(
        {
            "job_id": member.key,
            "kind": member.kind,
            "project": member.project,
            "architecture": member.architecture,
            "required_features": list(member.features),
            "paths": list(member.paths),
        }
    )
