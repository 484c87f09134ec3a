"""JobOffer: what a worker is offered, once per job and connection (workers.connection)."""

import threading

import pytest
from django.db import connection as db_connection
from django.db import transaction
from django.test.utils import CaptureQueriesContext

from gradient.jobs.models import Evaluation
from tests.factories import (
    BuildFactory,
    BuildMemberFactory,
    EvalMemberFactory,
    EvaluationFactory,
    WorkerFactory,
)
from workers import offers
from workers.assignment import candidates, offerable
from workers.models import JobScore
from workers.protocol import Score


def offered(worker, mark=None) -> list[str]:
    offer = offers.new_offers(worker.pk, mark=mark)
    return [] if offer is None else [job.job_id for job in offer.jobs]


def answer(worker, mark, keys):
    """The worker's JobScores for these jobs, as its session records them."""
    offers.record_scores(
        worker.pk, [Score(job_id=key, missing_count=1, missing_nar_size=10) for key in keys]
    )
    mark.answered(keys)


@pytest.mark.django_db
def test_both_kinds_are_offered_members_included_and_remembered():
    worker, mark = WorkerFactory(), offers.OfferMark()
    build, evaluation = BuildFactory(), EvaluationFactory()
    member = EvalMemberFactory()
    keys = sorted([build.job_key, evaluation.job_key, member.job_key])
    assert sorted(offered(worker, mark)) == keys
    assert not JobScore.objects.filter(worker=worker).exists()  # the answers write the rows
    assert offered(worker, mark) == []  # remembered by the session until answered


@pytest.mark.django_db
def test_an_answered_job_is_never_offered_again_an_unanswered_one_after_a_while():
    worker, mark = WorkerFactory(), offers.OfferMark()
    build, evaluation = BuildFactory(), EvaluationFactory()
    assert sorted(offered(worker, mark)) == sorted([build.job_key, evaluation.job_key])
    answer(worker, mark, [build.job_key])
    assert offered(worker, mark) == []
    mark.full_read_at -= offers.FULL_READ_EVERY + 1  # a full read, too soon for the unanswered
    assert offered(worker, mark) == []
    mark.full_read_at -= offers.FULL_READ_EVERY + 1
    mark.pending[evaluation.job_key] -= offers.FULL_READ_EVERY + 1
    assert offered(worker, mark) == [evaluation.job_key]
    assert offered(worker, mark) == []
    mark.reset()  # new capabilities: what is unanswered goes again at once
    assert offered(worker, mark) == [evaluation.job_key]


@pytest.mark.django_db
def test_a_fetch_only_worker_is_offered_no_member_evaluation():
    worker = WorkerFactory(can_eval=False, can_build=False, can_fetch=True)
    single = EvaluationFactory()
    EvalMemberFactory()
    BuildMemberFactory()
    assert offered(worker) == [single.job_key]


@pytest.mark.django_db
def test_a_long_queue_is_offered_oldest_first_the_rest_at_the_next_request(monkeypatch):
    monkeypatch.setattr(offers, "OFFER_BATCH", 2)
    worker = WorkerFactory(can_build=False)
    jobs = EvaluationFactory.create_batch(3)
    by_age = [
        e.job_key
        for e in Evaluation.objects.filter(pk__in=[j.pk for j in jobs]).order_by("created_at")
    ]
    mark = offers.OfferMark()
    assert offered(worker, mark) == by_age[:2]
    assert offered(worker, mark) == by_age[2:]


@pytest.mark.django_db
def test_jobs_the_worker_cannot_run_are_not_offered():
    worker = WorkerFactory()
    BuildFactory(architecture="riscv64-linux")
    BuildFactory(required_features=["kvm"])
    assert offered(worker) == []


@pytest.mark.django_db
def test_finished_evaluations_are_not_scanned_for_an_eval_slot():
    """Finished evaluations pile up until garbage collection; the offer and the candidates
    reach the startable ones through idx-evaluation-startable instead of scanning them."""
    worker = WorkerFactory()
    EvaluationFactory.create_batch(3)
    EvaluationFactory.create_batch(3, status="Fetching")
    EvaluationFactory.create_batch(3000, status="Completed")
    with db_connection.cursor() as cursor:
        cursor.execute("ANALYZE evaluation")
    for call in (
        lambda: offered(worker),
        lambda: candidates(worker, offerable(worker, "eval")),
    ):
        with CaptureQueriesContext(db_connection) as captured:
            call()
        with db_connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + captured.captured_queries[-1]["sql"])
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "idx-evaluation-startable" in plan, plan
        assert "Seq Scan on evaluation" not in plan, plan


# A session's mark (offers.OfferMark): only job rows written since its last offer are read.
# On committed rows, as a session sees them: inside a test's transaction the oldest running
# transaction is the test's own, and a mark could never pass the rows it wrote.


def forget_offers(mark):
    """As if the session had not remembered its offers: without a mark they would go again."""
    mark.pending.clear()


@pytest.mark.django_db(transaction=True)
def test_with_a_mark_only_jobs_written_since_the_last_offer_are_read():
    worker, mark = WorkerFactory(), offers.OfferMark()
    old = BuildFactory()
    assert offered(worker, mark) == [old.job_key]
    forget_offers(mark)
    assert offered(worker, mark) == []  # the row is older than the mark: not read
    new = BuildFactory()
    waiting = BuildFactory(status="Created")  # not startable: not offered
    assert offered(worker, mark) == [new.job_key]
    waiting.status = "Queued"  # its dependencies built: a new row version
    waiting.save()
    assert offered(worker, mark) == [waiting.job_key]
    # Without a mark every job is read (and without a session, nothing is remembered).
    assert sorted(offered(worker)) == sorted([old.job_key, new.job_key, waiting.job_key])


@pytest.mark.django_db(transaction=True)
def test_the_mark_is_dropped_for_a_full_read_now_and_then():
    worker, mark = WorkerFactory(), offers.OfferMark()
    job = EvaluationFactory()
    assert offered(worker, mark) == [job.job_key]
    forget_offers(mark)
    assert offered(worker, mark) == []
    mark.full_read_at -= offers.FULL_READ_EVERY + 1
    assert offered(worker, mark) == [job.job_key]
    forget_offers(mark)
    mark.reset()  # new capabilities
    assert offered(worker, mark) == [job.job_key]


@pytest.mark.django_db(transaction=True)
def test_an_offer_cut_short_keeps_its_mark_for_the_rest(monkeypatch):
    monkeypatch.setattr(offers, "OFFER_BATCH", 2)
    worker, mark = WorkerFactory(can_build=False), offers.OfferMark()
    jobs = EvaluationFactory.create_batch(3)
    first = offered(worker, mark)
    assert len(first) == 2
    assert offered(worker, mark) == [j.job_key for j in jobs if j.job_key not in first]
    assert offered(worker, mark) == []


class SlowSubmission:
    """A build inserted by a transaction on another connection that stays open until
    commit(): written before the offers that follow, committed after them."""

    def __init__(self, project):
        self.job = None
        self._written, self._go_on = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._submit, args=(project,))
        self._thread.start()
        assert self._written.wait(10)

    def _submit(self, project):
        try:
            with transaction.atomic():
                self.job = BuildFactory(project=project)
                self._written.set()
                self._go_on.wait(10)
        finally:
            db_connection.close()

    def commit(self):
        self._go_on.set()
        self._thread.join(10)


@pytest.mark.django_db(transaction=True)
def test_a_job_committed_after_an_offer_that_could_not_see_it_comes_with_the_next():
    """The race a watermark must not lose: a job written by a transaction that began before
    an offer read the jobs and committed after it. Its row is older than the offer's read,
    yet unseen by it; the mark is the oldest transaction still running, so it is read next."""
    worker, mark = WorkerFactory(), offers.OfferMark()
    project = BuildFactory().project
    assert len(offered(worker, mark)) == 1
    slow = SlowSubmission(project)
    quick = BuildFactory(project=project)  # committed at once, after the slow one's insert
    assert offered(worker, mark) == [quick.job_key]  # the slow one is not committed yet
    slow.commit()
    assert offered(worker, mark) == [slow.job.job_key]


@pytest.mark.django_db(transaction=True)
def test_after_a_read_that_found_nothing_a_cheap_probe_comes_first():
    worker, mark = WorkerFactory(), offers.OfferMark()
    BuildFactory()
    assert len(offered(worker, mark)) == 1
    assert offered(worker, mark) == []  # nothing new: the mark is quiet now
    assert mark.quiet
    before = mark.xmin

    with CaptureQueriesContext(db_connection) as queries:
        assert offered(worker, mark) == []
    # Only the worker's row and the probe: no job was written since the mark.
    assert [q["sql"] for q in queries][-1].lstrip().startswith("SELECT pg_snapshot_xmin")
    assert len(queries) == 2
    assert int(mark.xmin) >= int(before)  # moved on as the read would have

    new = EvaluationFactory()
    assert offered(worker, mark) == [new.job_key]
    assert not mark.quiet


@pytest.mark.django_db(transaction=True)
def test_a_job_committed_after_a_probe_that_could_not_see_it_comes_with_the_next():
    worker, mark = WorkerFactory(), offers.OfferMark()
    project = BuildFactory().project
    assert len(offered(worker, mark)) == 1
    assert offered(worker, mark) == []  # quiet
    slow = SlowSubmission(project)
    assert offered(worker, mark) == []  # the probe cannot see it yet, and moves the mark
    slow.commit()
    assert offered(worker, mark) == [slow.job.job_key]
