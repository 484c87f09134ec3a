"""The verdict as pure functions: one test per row of the spec's table, one per named race,
and the edges; then where each member's job goes."""

import pytest

from clusters.verdict import (
    ABORTING_FAILURES,
    LOST,
    REQUEUEING_FAILURES,
    MemberState,
    Settlement,
    Verdict,
    decide,
    member_moves,
)


def m(key, outcome=None, primary=False, kind=None, dead=False, aborted=False):
    return MemberState(key, primary, outcome, kind, dead, aborted)


def test_complete_when_every_member_succeeded():
    members = [m("a", "Completed"), m("b", "Completed")]
    assert decide(members, budget_left=False) == Verdict.COMPLETE


def test_complete_when_the_primary_succeeded_while_others_run():
    members = [m("server", "Completed", primary=True), m("client")]
    assert decide(members, budget_left=False) == Verdict.COMPLETE


def test_no_verdict_while_a_non_primary_member_succeeded_and_others_run():
    assert decide([m("a", "Completed"), m("b")], budget_left=True) is None
    assert decide([m("a"), m("b")], budget_left=True) is None


def test_retry_when_a_member_failed_with_budget_left():
    members = [m("a", "Completed"), m("b", "Failed", kind="transient")]
    assert decide(members, budget_left=True) == Verdict.RETRY


def test_retry_when_a_member_was_lost_with_budget_left():
    assert decide([m("a"), m("b", "Failed", kind="lost")], budget_left=True) == Verdict.RETRY


def test_fail_without_budget():
    members = [m("a"), m("b", "Failed", kind="transient")]
    assert decide(members, budget_left=False) == Verdict.FAIL


def test_fail_when_a_member_can_no_longer_start():
    members = [m("a", dead=True), m("b", "Failed", kind="transient")]
    assert decide(members, budget_left=True) == Verdict.FAIL
    permanent = [m("a"), m("b", "Failed", kind="permanent")]
    assert decide(permanent, budget_left=True) == Verdict.FAIL


def test_a_failure_outweighs_a_primary_success_reported_in_the_same_decision():
    # The first deciding report wins; when a failure is already in, the attempt failed.
    members = [m("a", "Failed", kind="transient"), m("b", "Completed", primary=True)]
    assert decide(members, budget_left=True) == Verdict.RETRY


def test_fail_when_a_member_can_no_longer_start_though_none_reported():
    # Its job ended outside the attempt (a cancel, a removal): the sweep asks the verdict.
    assert decide([m("a", dead=True), m("b")], budget_left=True) == Verdict.FAIL


def test_abort_when_an_evaluation_abort_reached_a_member():
    # The member's job is Aborted: whatever the others reported, and with budget left.
    members = [m("a", "Completed", primary=True), m("b", aborted=True, dead=True)]
    assert decide(members, budget_left=True) == Verdict.ABORT
    reported = [m("a", "Failed", kind="aborted", aborted=True, dead=True), m("b")]
    assert decide(reported, budget_left=True) == Verdict.ABORT


def test_abort_when_the_operator_aborts_the_cluster():
    members = [m("a", "Completed"), m("b")]
    assert decide(members, budget_left=True, aborted=True) == Verdict.ABORT


@pytest.mark.parametrize("kind", sorted(ABORTING_FAILURES))
def test_an_abort_the_server_did_not_order_is_a_failure(kind):
    # The worker aborted on its own; no evaluation abort reached the member's job.
    members = [m("a", "Failed", kind=kind), m("b")]
    assert decide(members, budget_left=True) == Verdict.RETRY
    assert decide(members, budget_left=False) == Verdict.FAIL


def test_no_members_decide_nothing():
    assert decide([], budget_left=True) is None


# Where the members go: member_moves, a test per race the spec names.


def test_a_report_racing_the_resolution_is_settled_late_by_the_verdict():
    # "b" still runs when "a" decides: the verdict settles it, so its own report, arriving
    # during or after the resolution, has nothing left to decide.
    failed = [m("a", "Failed", kind="transient"), m("b")]
    assert member_moves(decide(failed, budget_left=True), failed)["b"] == Settlement.REQUEUED
    assert member_moves(decide(failed, budget_left=False), failed)["b"] == Settlement.ABORTED


def test_a_completed_member_is_requeued_when_a_sibling_fails():
    members = [m("a", "Completed"), m("b", "Failed", kind="transient"), m("c")]
    verdict = decide(members, budget_left=True)
    assert verdict == Verdict.RETRY
    assert set(member_moves(verdict, members).values()) == {Settlement.REQUEUED}


@pytest.mark.parametrize("kind", sorted(REQUEUEING_FAILURES | {LOST}))
def test_a_spent_budget_turns_requeueing_kinds_permanent(kind):
    members = [m("a", "Completed"), m("b", "Failed", kind=kind), m("c")]
    verdict = decide(members, budget_left=False)
    assert verdict == Verdict.FAIL
    assert member_moves(verdict, members) == {
        "a": Settlement.COMPLETED,
        "b": Settlement.FAILED,
        "c": Settlement.ABORTED,  # a survivor
    }


@pytest.mark.parametrize("kind", sorted(ABORTING_FAILURES))
def test_a_member_that_reported_its_own_abort_ends_aborted_when_the_cluster_fails(kind):
    members = [m("a", "Failed", kind=kind)]
    assert member_moves(decide(members, budget_left=False), members) == {"a": Settlement.ABORTED}


def test_the_primary_completes_the_cluster_and_aborts_its_companions():
    members = [m("server", "Completed", primary=True), m("client"), m("agent")]
    verdict = decide(members, budget_left=True)
    assert verdict == Verdict.COMPLETE
    assert member_moves(verdict, members) == {
        "server": Settlement.COMPLETED,
        "client": Settlement.ABORTED,
        "agent": Settlement.ABORTED,
    }


def test_an_abort_settles_reported_members_and_aborts_the_survivors():
    members = [m("a", "Completed"), m("b", aborted=True, dead=True), m("c")]
    assert member_moves(decide(members, budget_left=True), members) == {
        "a": Settlement.COMPLETED,
        "b": Settlement.ABORTED,
        "c": Settlement.ABORTED,
    }
