"""The guarded transitions of evaluations and shared builds (gradient.jobs.transitions): every
move the state machines allow happens, every other one changes nothing."""

import psycopg
import pytest
from django.db import connection

from clusters.claim import ClusterClaim, _undo
from gradient.jobs.models import (
    BUILD_TERMINAL,
    EVALUATION_TERMINAL,
    BuildStatus,
    DerivationBuild,
    Evaluation,
    EvaluationStatus,
)
from gradient.jobs.transitions import (
    BUILD_SOURCES,
    EVALUATION_SOURCES,
    IllegalTransition,
    advance_build,
    advance_builds,
    advance_evaluation,
    advance_evaluations,
)
from tests.factories import BuildFactory, ClusterFactory, EvaluationFactory

# The states issue #2 names for the existing jobs.
EVALUATION_STATES = {
    "Queued",
    "Fetching",
    "EvaluatingFlake",
    "EvaluatingDerivation",
    "Building",
    "Completed",
    "Failed",
    "Aborted",
}
BUILD_STATES = {
    "Created",
    "Queued",
    "Building",
    "Completed",
    "FailedPermanent",
    "Aborted",
    "DependencyFailed",
    "Substituted",
    "FailedTransient",
    "FailedTimeout",
}

# Every allowed move, by source, written out independently of the tables in transitions.py:
# a change there must be made here too, on purpose. A state not listed moves nowhere.
EVALUATION_MOVES = {
    "Queued": {"Fetching", "EvaluatingFlake", "Failed", "Aborted"},
    "Fetching": {"Queued", "EvaluatingFlake", "Failed", "Aborted"},
    # Back to Queued: a cluster's Retry, or a single evaluation's assignment released.
    "EvaluatingFlake": {"Queued", "EvaluatingDerivation", "Completed", "Failed", "Aborted"},
    "EvaluatingDerivation": {"Queued", "Building", "Completed", "Failed", "Aborted"},
    "Building": {"Completed", "Failed", "Aborted"},
}
BUILD_MOVES = {
    "Created": {"Queued", "DependencyFailed", "Aborted"},
    # To Building: the spec's Assigned transition at the claim.
    "Queued": {"Building", "Substituted", "DependencyFailed", "Aborted"},
    # Back to Queued: released before the build ran (a failed prepare, a Retry).
    "Building": {
        "Queued",
        "Completed",
        "Substituted",
        "FailedTransient",
        "FailedTimeout",
        "FailedPermanent",
        "Aborted",
    },
    "FailedTransient": {"Queued", "FailedPermanent", "Aborted"},
    "FailedTimeout": {"Queued", "FailedPermanent", "Aborted"},
}

MACHINES = {
    "evaluation": (
        EvaluationStatus,
        EVALUATION_STATES,
        EVALUATION_SOURCES,
        EVALUATION_MOVES,
        EVALUATION_TERMINAL,
    ),
    "build": (BuildStatus, BUILD_STATES, BUILD_SOURCES, BUILD_MOVES, BUILD_TERMINAL),
}
JOBS = {
    "evaluation": (Evaluation, EvaluationFactory, advance_evaluation, advance_evaluations),
    "build": (DerivationBuild, BuildFactory, advance_build, advance_builds),
}


def moves_of(sources: dict) -> dict[str, set[str]]:
    """A `target -> sources` table turned around: source -> targets."""
    out: dict[str, set[str]] = {}
    for target, froms in sources.items():
        for source in froms:
            out.setdefault(str(source), set()).add(str(target))
    return out


@pytest.mark.parametrize("kind", MACHINES)
def test_the_state_machine_has_the_issues_states_and_its_moves(kind):
    statuses, states, sources, moves, _ = MACHINES[kind]

    assert set(statuses.values) == states
    assert set(map(str, sources)) <= states
    assert moves_of(sources) == moves


@pytest.mark.parametrize("kind", MACHINES)
def test_no_job_leaves_a_finished_state(kind):
    _, _, sources, _, terminal = MACHINES[kind]

    assert not set(moves_of(sources)) & set(terminal)


CASES = [(kind, target) for kind in MACHINES for target in sorted(MACHINES[kind][1])]


def jobs_in_every_state(kind: str) -> dict[str, object]:
    _, factory, _, _ = JOBS[kind]
    return {state: factory(status=state) for state in sorted(MACHINES[kind][1])}


def statuses_now(kind: str, jobs: dict) -> dict[str, str]:
    model = JOBS[kind][0]
    now = dict(model.objects.values_list("pk", "status"))
    return {state: now[job.pk] for state, job in jobs.items()}


def expected_after(kind: str, target: str) -> tuple[set[str], dict[str, str]]:
    moves = MACHINES[kind][3]
    movers = {s for s in MACHINES[kind][1] if target in moves.get(s, ())}
    return movers, {s: target if s in movers else s for s in MACHINES[kind][1]}


@pytest.mark.django_db
@pytest.mark.parametrize("batch", [False, True], ids=["singly", "as-a-batch"])
@pytest.mark.parametrize(("kind", "target"), CASES, ids=[f"{k}-to-{t}" for k, t in CASES])
def test_a_job_moves_from_every_allowed_source_and_from_no_other(kind, target, batch):
    _, _, advance_one, advance_all = JOBS[kind]
    jobs = jobs_in_every_state(kind)
    pks = [job.pk for job in jobs.values()]
    calls = [pks] if batch else [[pk] for pk in pks]
    advance = advance_all if batch else lambda pks, to: int(advance_one(pks[0], to))
    movers, after = expected_after(kind, target)

    if not movers:
        for call in calls:
            with pytest.raises(IllegalTransition):
                advance(call, target)
    else:
        assert sum(advance(call, target) for call in calls) == len(movers)

    assert statuses_now(kind, jobs) == after


@pytest.mark.django_db
def test_expect_narrows_the_sources_and_a_disjoint_one_is_illegal():
    building = BuildFactory(status=BuildStatus.BUILDING)

    assert not advance_build(building.pk, BuildStatus.QUEUED, expect=[BuildStatus.FAILED_TIMEOUT])
    with pytest.raises(IllegalTransition):
        advance_build(building.pk, BuildStatus.BUILDING, expect=[BuildStatus.CREATED])
    building.refresh_from_db()
    assert building.status == BuildStatus.BUILDING

    assert advance_build(building.pk, BuildStatus.QUEUED, expect=[BuildStatus.BUILDING])
    building.refresh_from_db()
    assert building.status == BuildStatus.QUEUED


# The batch claim's undo (clusters.claim._undo) writes a status too: only from Building.


@pytest.mark.django_db
def test_a_lost_batch_claim_sends_back_to_queued_only_builds_still_building():
    cluster = ClusterFactory()
    building = BuildFactory(status=BuildStatus.BUILDING)
    finished = BuildFactory(status=BuildStatus.COMPLETED)
    builds = {building.pk: cluster.pk, finished.pk: cluster.pk}
    connection.ensure_connection()

    _undo(
        lambda: psycopg.Cursor(connection.connection),
        [ClusterClaim(cluster_id=cluster.pk, members=[])],
        builds,
        moved=set(builds),
    )

    assert dict(DerivationBuild.objects.values_list("pk", "status")) == {
        building.pk: BuildStatus.QUEUED,
        finished.pk: BuildStatus.COMPLETED,
    }
