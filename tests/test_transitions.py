"""The five state machines (evaluation, build, cluster job, attempt, dispatched job) and their
guarded writes: every move a machine allows happens, every other one changes nothing, walked
over every (source, target) pair against tables written apart from the code."""

import pytest
from django.db import connection
from django.utils import timezone

from clusters.claim import close_cluster_attempt
from clusters.models import (
    ATTEMPT_MACHINE,
    CLUSTER_MACHINE,
    CLUSTER_TERMINAL,
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterStatus,
)
from gradient.jobs.models import (
    BUILD_MACHINE,
    BUILD_TERMINAL,
    DISPATCHED_MACHINE,
    EVALUATION_MACHINE,
    EVALUATION_TERMINAL,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchedOutcome,
    Evaluation,
    EvaluationStatus,
)
from gradient.jobs.states import IllegalTransition
from gradient.jobs.transitions import (
    advance_build,
    advance_builds,
    advance_evaluation,
    advance_evaluations,
    finish_assignments,
    move,
)
from tests.factories import BuildFactory, ClusterFactory, EvaluationFactory, WorkerFactory

# The states issue #2 names for the existing jobs, and the spec's for clusters and attempts;
# an attempt is also Open (claimed) and Started before its outcome, a dispatched job Open
# (finished_at NULL) before its outcome.
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
CLUSTER_STATES = {"Queued", "Running", "Completed", "Failed", "Aborted"}
ATTEMPT_STATES = {"Open", "Started", "Succeeded", "Failed", "PrepareFailed", "Aborted"}
DISPATCHED_STATES = {"Open", "Completed", "Failed", "Abandoned"}

# Every allowed move, by source, written out independently of the machines' tables: a change
# there must be made here too, on purpose. A state not listed moves nowhere.
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
CLUSTER_MOVES = {
    # Running: its attempt started; Aborted: an operator's abort while it waits or prepares.
    "Queued": {"Running", "Aborted"},
    # The verdict on its started attempt (Retry back to Queued), or an abort.
    "Running": {"Queued", "Completed", "Failed", "Aborted"},
}
ATTEMPT_MOVES = {
    # Started on the last acceptance; a failed prepare or an abort before that.
    "Open": {"Started", "PrepareFailed", "Aborted"},
    # The verdict.
    "Started": {"Succeeded", "Failed", "Aborted"},
}
DISPATCHED_MOVES = {"Open": {"Completed", "Failed", "Abandoned"}}


def new_evaluation(state):
    return EvaluationFactory(status=state).pk


def new_build(state):
    return BuildFactory(status=state).pk


def new_cluster(state):
    return ClusterFactory(status=state).pk


def new_attempt(state):
    """An attempt of a cluster of its own (one open attempt a cluster), in `state`."""
    now = timezone.now()
    finished = state not in ("Open", "Started")
    return ClusterAttempt.objects.create(
        cluster_job=ClusterFactory(),
        created_at=now,
        started_at=now if state == "Started" else None,
        finished_at=now if finished else None,
        outcome=state if finished else None,
    ).pk


def new_dispatched(state):
    evaluation = EvaluationFactory()
    open_ = state == "Open"
    return DispatchedJob.objects.create(
        kind="eval",
        job_id=f"eval:{evaluation.pk}",
        evaluation=evaluation,
        worker_id=WorkerFactory().pk,
        project_id=evaluation.project_id,
        dispatched_at=timezone.now(),
        finished_at=None if open_ else timezone.now(),
        outcome=None if open_ else state,
    ).pk


def attempt_state(a: ClusterAttempt) -> str:
    if a.finished_at is not None:
        return a.outcome
    return "Started" if a.started_at is not None else "Open"


def dispatched_state(d: DispatchedJob) -> str:
    return "Open" if d.finished_at is None else d.outcome


# name: (machine, its states, its moves, its final states, enum values it must hold,
#        a row in a state, the rows' states now)
MACHINES = {
    "evaluation": (
        EVALUATION_MACHINE,
        EVALUATION_STATES,
        EVALUATION_MOVES,
        EVALUATION_TERMINAL,
        set(EvaluationStatus.values),
        new_evaluation,
        lambda: dict(Evaluation.objects.values_list("pk", "status")),
    ),
    "build": (
        BUILD_MACHINE,
        BUILD_STATES,
        BUILD_MOVES,
        BUILD_TERMINAL,
        set(BuildStatus.values),
        new_build,
        lambda: dict(DerivationBuild.objects.values_list("pk", "status")),
    ),
    "cluster": (
        CLUSTER_MACHINE,
        CLUSTER_STATES,
        CLUSTER_MOVES,
        CLUSTER_TERMINAL,
        set(ClusterStatus.values),
        new_cluster,
        lambda: dict(ClusterJob.objects.values_list("pk", "status")),
    ),
    "attempt": (
        ATTEMPT_MACHINE,
        ATTEMPT_STATES,
        ATTEMPT_MOVES,
        set(AttemptOutcome.values),
        set(AttemptOutcome.values),
        new_attempt,
        lambda: {a.pk: attempt_state(a) for a in ClusterAttempt.objects.all()},
    ),
    "dispatched": (
        DISPATCHED_MACHINE,
        DISPATCHED_STATES,
        DISPATCHED_MOVES,
        set(DispatchedOutcome.values),
        set(DispatchedOutcome.values),
        new_dispatched,
        lambda: {d.pk: dispatched_state(d) for d in DispatchedJob.objects.all()},
    ),
}


def moves_of(sources: dict) -> dict[str, set[str]]:
    """A `target -> sources` table turned around: source -> targets."""
    out: dict[str, set[str]] = {}
    for target, froms in sources.items():
        for source in froms:
            out.setdefault(str(source), set()).add(str(target))
    return out


@pytest.mark.parametrize("name", MACHINES)
def test_the_state_machine_has_the_specs_states_and_its_moves(name):
    machine, states, moves, _, values, _, _ = MACHINES[name]

    assert set(machine.states) == states
    assert values <= states
    assert set(map(str, machine.sources)) <= states
    assert moves_of(machine.sources) == moves


@pytest.mark.parametrize("name", MACHINES)
def test_nothing_leaves_a_final_state(name):
    machine, _, _, terminal, _, _, _ = MACHINES[name]

    assert not set(moves_of(machine.sources)) & set(terminal)


def rows_in_every_state(name: str) -> dict[str, object]:
    states, new = MACHINES[name][1], MACHINES[name][5]
    return {state: new(state) for state in sorted(states)}


def states_now(name: str, rows: dict) -> dict[str, str]:
    now = MACHINES[name][6]()
    return {state: now[pk] for state, pk in rows.items()}


def expected_after(name: str, target: str) -> tuple[set[str], dict[str, str]]:
    states, moves = MACHINES[name][1], MACHINES[name][2]
    movers = {s for s in states if target in moves.get(s, ())}
    return movers, {s: target if s in movers else s for s in states}


def each(machine, pks, to) -> int:
    """update_each, the settling's form: every row to its own target (here the same one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            machine.update_each("x"), machine.bind_each("x", [(pk, to, None) for pk in pks])
        )
        return cursor.rowcount


# The guarded writes: move() for every machine, update_each() for the jobs settling moves,
# and the wrappers the callers use.
WRITES = {
    "evaluation": {
        "move": lambda pks, to: move(EVALUATION_MACHINE, pks, to),
        "update_each": lambda pks, to: each(EVALUATION_MACHINE, pks, to),
        "advance_evaluation": lambda pks, to: int(advance_evaluation(pks[0], to)),
        "advance_evaluations": advance_evaluations,
    },
    "build": {
        "move": lambda pks, to: move(BUILD_MACHINE, pks, to),
        "update_each": lambda pks, to: each(BUILD_MACHINE, pks, to),
        "advance_build": lambda pks, to: int(advance_build(pks[0], to)),
        "advance_builds": advance_builds,
    },
    "cluster": {"move": lambda pks, to: move(CLUSTER_MACHINE, pks, to)},
    "attempt": {"move": lambda pks, to: move(ATTEMPT_MACHINE, pks, to)},
    "dispatched": {
        "move": lambda pks, to: move(DISPATCHED_MACHINE, pks, to),
        "finish_assignments": finish_assignments,
    },
}
SINGLE = {"advance_evaluation", "advance_build"}
CASES = [
    (name, write, target, batch)
    for name in MACHINES
    for write in WRITES[name]
    for target in sorted(MACHINES[name][1])
    for batch in ([False] if write in SINGLE else [False, True])
]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("name", "write", "target", "batch"),
    CASES,
    ids=[f"{w}-{n}-to-{t}-{'as-a-batch' if b else 'singly'}" for n, w, t, b in CASES],
)
def test_a_row_moves_from_every_allowed_source_and_from_no_other(name, write, target, batch):
    advance = WRITES[name][write]
    rows = rows_in_every_state(name)
    pks = list(rows.values())
    calls = [pks] if batch else [[pk] for pk in pks]
    movers, after = expected_after(name, target)

    if not movers:
        for call in calls:
            with pytest.raises(IllegalTransition):
                advance(call, target)
    else:
        assert sum(advance(call, target) for call in calls) == len(movers)

    assert states_now(name, rows) == after


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


OUTCOMES = sorted(AttemptOutcome.values)


@pytest.mark.django_db
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_the_close_moves_an_attempt_only_as_its_machine_allows(outcome):
    """close_cluster_attempt carries the attempt's guarded write inside its one statement."""
    rows = rows_in_every_state("attempt")
    movers, after = expected_after("attempt", outcome)

    closed = {state for state, pk in rows.items() if close_cluster_attempt(pk, outcome)}

    assert closed == movers
    assert states_now("attempt", rows) == after


@pytest.mark.django_db
@pytest.mark.parametrize("status", sorted(CLUSTER_STATES))
def test_a_close_that_would_move_the_cluster_illegally_closes_nothing(status):
    """Asked to move the cluster too, the close moves all three or none: a started attempt of
    a cluster that is not Running (no verdict may then move it) stays open, its rows too."""
    cluster = ClusterFactory(status=status)
    attempt = ClusterAttempt.objects.create(
        cluster_job=cluster, created_at=timezone.now(), started_at=timezone.now()
    )
    row = DispatchedJob.objects.get(pk=new_dispatched("Open"))
    DispatchedJob.objects.filter(pk=row.pk).update(cluster_attempt=attempt)
    movable = "Completed" in CLUSTER_MOVES.get(status, ())

    closed = close_cluster_attempt(
        attempt.pk, AttemptOutcome.SUCCEEDED, cluster_status=ClusterStatus.COMPLETED
    )

    assert bool(closed) == movable
    attempt.refresh_from_db()
    cluster.refresh_from_db()
    row.refresh_from_db()
    assert (attempt.finished_at is not None, row.finished_at is not None) == (movable, movable)
    assert cluster.status == ("Completed" if movable else status)


@pytest.mark.django_db
def test_a_guarded_write_of_no_rows_sends_no_statement(django_assert_num_queries):
    with django_assert_num_queries(0):
        assert move(CLUSTER_MACHINE, [], ClusterStatus.ABORTED) == 0
        assert finish_assignments([], DispatchedOutcome.ABANDONED) == 0
        assert advance_builds([], BuildStatus.QUEUED) == 0
