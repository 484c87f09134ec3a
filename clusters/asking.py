"""Asking the idle seats for their scores (protocol.md, the head of the queue).

A cluster that becomes able to start is offered at once to the idle workers that could seat
its members, and the dispatch pass places it on their answers, or GRADIENT_SCORE_WAIT_MS after
the offers for a worker that has not answered: a cluster that meets an idle fleet is seated by
its scores, not by ties. The offers are job_score rows without a score, as a session's are, so
each pair is offered once per connection whichever process offers it.

- A pass asks for the clusters of its head only (GRADIENT_OFFER_WINDOW members of a kind, in
  the planner's order), each member of at most two windows of its idle seats; a new cluster
  beyond the head waits for a later pass.
- A cluster asked before is asked again only when its placement would seat a member on a
  worker that never scored it (the seats that scored it are taken, and the others came free
  since, past their own heads), in rounds: a round holds it the score
  wait at most from its start (cluster_job.offered_at), and the next may begin a score wait
  after the last ended, so that a cluster is always placed in time however often seats come
  free.
"""

import json
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from itertools import zip_longest

from django.conf import settings
from django.db import connection
from django.utils import timezone

from clusters import planner
from clusters.tracking import StartableCluster
from gradient.postgresql.arrays import int_array, text_array
from gradient.wire.groups import send_frames
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
    ORDER BY p.worker_id, p.job_id  -- the sessions' order (workers.offers): no deadlock
    ON CONFLICT (worker_id, job_id) DO NOTHING
    RETURNING worker_id, job_id
)
SELECT worker_id, array_agg(job_id) FROM fresh GROUP BY worker_id
"""

ASKED_SQL = """
SELECT worker_id, job_id FROM job_score
WHERE job_id = ANY(%(keys)s::text[]) AND worker_id = ANY(%(workers)s::bigint[])
"""

MARK_SQL = """
UPDATE cluster_job SET offered_at = %(now)s WHERE id = ANY(%(clusters)s::bigint[])
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
        self.began = {c.id: c.offered_at for c in clusters}  # each one's round of asking
        self.asked: set[int] = set()  # clusters asked this pass
        self.counted: set[int] = set()  # clusters counted against the head
        self.rounds: list[int] = []  # clusters whose round of asking begins with this pass
        self.items: dict[int, list[str]] = defaultdict(list)  # worker -> its offer's jobs
        self.unanswered = self._unanswered(clusters, [w.id for w in workers])

    def ask_new(self) -> None:
        """Offer the clusters that became able to start to the idle workers that could seat
        them, in the planner's order while the head has room, whether or not those are enough
        to place them yet: their scores are in by the time the last seat comes free."""
        if not score_wait():
            return
        for cluster in self.book.values():
            if self.began[cluster.id] is None:
                if not self._fits(cluster):
                    break
                if self._ask(cluster):
                    self._count(cluster)
        self._send()  # before planning: the seats score while the pass plans

    def ready(self, placement: planner.Placement) -> bool:
        cluster = self.book[placement.cluster_id]
        if not score_wait():
            return True  # GRADIENT_SCORE_WAIT_MS=0: placed at once on the scores there are
        began = self.began[cluster.id]
        if began is None and not self._fits(cluster):
            self._hold(self.now)  # asked by a later pass, once the head has room
            return False
        open_round = began is not None and self.now - began < score_wait()
        if began is not None and not open_round and placement.cost < planner.UNSCORED_COST:
            return True  # asked before and every seat chosen has its score: no blind seat
        may_ask = open_round or began is None or self.now - began >= 2 * score_wait()
        asked = cluster.id in self.asked or (may_ask and self._fits(cluster) and self._ask(cluster))
        began = self.began[cluster.id]
        pending = any(m.key in self.unanswered for m in cluster.members)
        if began is not None and self.now - began < score_wait() and (asked or pending):
            self._count(cluster)
            self._hold(began)
            return False
        return True

    def _ask(self, cluster: StartableCluster) -> bool:
        """Offer the cluster to its idle seats that never scored it, and begin a round of
        asking unless one is open; whether any seat was asked."""
        if not self._offer(cluster):
            return False
        self.asked.add(cluster.id)
        began = self.began[cluster.id]
        if began is None or self.now - began >= score_wait():
            self.began[cluster.id] = self.now  # held at most the score wait from here
            self.rounds.append(cluster.id)
        return True

    def _fits(self, cluster: StartableCluster) -> bool:
        if cluster.id in self.counted:
            return True
        kinds = Counter(m.kind for m in cluster.members)
        return all(self.left[kind] >= n for kind, n in kinds.items())

    def _count(self, cluster: StartableCluster) -> None:
        if cluster.id not in self.counted:
            self.counted.add(cluster.id)
            self.left -= Counter(m.kind for m in cluster.members)

    def finish(self) -> None:
        """Send the offers made while planning and record their rounds."""
        self._send()

    def _send(self) -> None:
        """One JobOffer per worker, not waited for (a frame is a Redis round trip or three:
        waited for per cluster, they made a busy fleet's passes several times slower); then
        when each round began."""
        if self.items:
            send_frames(
                [
                    (worker_id, RenderedOffer("[" + ",".join(jobs) + "]"))
                    for worker_id, jobs in self.items.items()
                ],
                event="worker.offer",
                # A lost offer only makes its cluster wait the score wait out. (Inside a
                # caller's transaction, as in tests, sent before the pass returns.)
                wait=connection.in_atomic_block,
            )
            self.items.clear()
        if self.rounds:
            # A round runs from when its offers left, not from the pass's start: a slow pass
            # would otherwise spend its seats' score wait before they were asked.
            sent = timezone.now()
            with connection.cursor() as cursor:
                cursor.execute(MARK_SQL, {"now": sent, "clusters": int_array(self.rounds)})
            self.rounds.clear()
            if self.due is not None:
                # The pass for the held clusters comes as late as their offers left: earlier,
                # it would find their seats' offers past the score wait and place them unanswered.
                self.due += sent - self.now

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

    def _asked_before(self, eligible: dict[str, list[planner.Worker]]) -> set[tuple[int, str]]:
        """The (worker, job) pairs among these that the workers were offered already: the
        window of seats asked is taken from the others, so that a large idle set is asked in
        turn rather than the same workers every time."""
        workers = {w.id for seats_of in eligible.values() for w in seats_of}
        if not workers:
            return set()
        with connection.cursor() as cursor:
            cursor.execute(
                ASKED_SQL,
                {"keys": text_array(list(eligible)), "workers": int_array(sorted(workers))},
            )
            return set(cursor.fetchall())

    def _offer(self, cluster: StartableCluster) -> bool:
        """Offer the cluster's members to the idle workers that could seat them and were not
        offered them yet (a window of them per member); whether any was."""
        eligible = {m.key: seats(m.planned(), self.alike) for m in cluster.members}
        done = self._asked_before(eligible)
        pairs = [
            (worker.id, key)
            for key, workers in eligible.items()
            for worker in asked([w for w in workers if (w.id, key) not in done], cluster.id)
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
        for worker_id, keys in fresh:
            self.items[worker_id] += [items[k] for k in keys]
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


def asked(workers: list[planner.Worker], cluster_id: int) -> list[planner.Worker]:
    """At most twice a window of a member's seats, taken in turn from each zone: what a start
    costs stays bounded however large an idle fleet, and a same_zone cluster has scored seats
    in every zone to choose among. Each cluster takes them in an order of its own, so that the
    clusters of a pass are not all asked of the same few workers. (One window asked left a
    fifth of a 200-worker deep queue's idle seats unscored: 1.14 x the bytes of full scoring,
    against 1.00 with two; bench/placement.py.)"""
    by_zone = defaultdict(list)
    for worker in sorted(workers, key=lambda w: hash((cluster_id, w.id))):
        by_zone[worker.zone].append(worker)
    turns = zip_longest(*by_zone.values())
    return [w for turn in turns for w in turn if w is not None][: 2 * window()]


def _profile(worker: planner.Worker) -> tuple:
    return (
        worker.idle_kinds,
        worker.architectures,
        worker.features,
        worker.projects,
        worker.can_eval,
        worker.can_build,
        worker.quarantined,
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
