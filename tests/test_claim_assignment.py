import pytest
from django.utils import timezone

from gradient.errors import NotAllowed
from gradient.jobs.claim import Assignment, ClaimGate
from gradient.jobs.models import BuildStatus, DispatchedJob, JobKind
from gradient.wire.keys import job_key
from sessions import reports
from tests.clusterflow import claim_assignment
from tests.concurrency import race
from tests.factories import BuildFactory, EvaluationFactory, WorkerFactory


def assignment(job, worker, kind=JobKind.EVAL, substitute=False):
    return Assignment(
        gate=ClaimGate(kind, job.pk, substitute),
        worker_id=worker.pk,
        project_id=job.project_id,
    )


@pytest.mark.django_db
def test_a_claim_opens_one_row_under_the_job_key():
    evaluation, worker = EvaluationFactory(), WorkerFactory()
    claim = assignment(evaluation, worker)
    assert claim_assignment(claim)
    row = DispatchedJob.objects.get()
    assert (row.id, row.job_id, row.kind) == (claim.id, f"eval:{evaluation.pk}", "eval")
    assert row.evaluation_id == evaluation.pk and row.finished_at is None


@pytest.mark.django_db
def test_a_second_claim_of_an_open_job_loses():
    evaluation = EvaluationFactory()
    assert claim_assignment(assignment(evaluation, WorkerFactory()))
    assert not claim_assignment(assignment(evaluation, WorkerFactory()))
    assert DispatchedJob.objects.count() == 1


@pytest.mark.django_db
def test_a_job_can_be_claimed_again_once_its_row_is_finished():
    evaluation, worker = EvaluationFactory(), WorkerFactory()
    assert claim_assignment(assignment(evaluation, worker))
    DispatchedJob.objects.update(finished_at=timezone.now(), outcome="Abandoned")
    assert claim_assignment(assignment(evaluation, worker))


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["Completed", "Failed", "Aborted"])
def test_a_finished_evaluation_cannot_be_claimed(status):
    evaluation = EvaluationFactory(status=status)
    assert not claim_assignment(assignment(evaluation, WorkerFactory()))
    assert not DispatchedJob.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("status", [s for s in BuildStatus if s != BuildStatus.QUEUED])
def test_a_build_that_is_not_queued_cannot_be_claimed(status):
    build = BuildFactory(status=status)
    assert not claim_assignment(assignment(build, WorkerFactory(), JobKind.BUILD))


@pytest.mark.django_db
def test_a_build_claim_must_see_the_current_substitute_mode():
    build = BuildFactory(cache_available=True)
    worker = WorkerFactory()
    assert not claim_assignment(assignment(build, worker, JobKind.BUILD, substitute=False))
    assert claim_assignment(assignment(build, worker, JobKind.BUILD, substitute=True))
    assert DispatchedJob.objects.get().derivation_build_id == build.pk


@pytest.mark.django_db
def test_a_job_is_reported_under_its_own_key_and_under_no_other():
    """A worker names the job by the key the claim gave it; any other string, of another kind,
    another job or no key at all, finds nothing and changes nothing."""
    evaluation, worker = EvaluationFactory(), WorkerFactory()
    claim = assignment(evaluation, worker)
    assert claim_assignment(claim)
    key = job_key(JobKind.EVAL, evaluation.pk)
    assert key == f"eval:{evaluation.pk}" == DispatchedJob.objects.get().job_id
    for bad in ["eval", "job:1", f"build:{evaluation.pk}", f"{key}x", ""]:
        with pytest.raises(NotAllowed):
            reports.job_completed(worker.pk, bad, str(claim.id))
    assert DispatchedJob.objects.get().finished_at is None
    reports.job_completed(worker.pk, key, str(claim.id))
    assert DispatchedJob.objects.get().outcome == "Completed"


TRIALS = 100
CLAIMERS = 4


@pytest.mark.django_db(transaction=True)
def test_racing_claimers_of_one_job_leave_exactly_one_winner():
    workers = WorkerFactory.create_batch(CLAIMERS)
    for _ in range(TRIALS):
        job = EvaluationFactory() if _ % 2 else BuildFactory()
        kind = JobKind.EVAL if _ % 2 else JobKind.BUILD
        claims = [assignment(job, w, kind) for w in workers]
        results = race(*[lambda c=c: claim_assignment(c) for c in claims])
        assert sum(results) == 1, results
        key = f"{kind}:{job.pk}"
        open_rows = DispatchedJob.objects.filter(job_id=key, finished_at__isnull=True)
        assert list(open_rows.values_list("id", flat=True)) == [claims[results.index(True)].id]
