"""The verdict as a pure function: one test per row of the spec's table, and the edges."""

from clusters.verdict import MemberState, Verdict, decide


def m(key, outcome=None, primary=False, kind=None, dead=False):
    return MemberState(key=key, primary=primary, outcome=outcome, failure_kind=kind, dead=dead)


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


def test_abort_when_an_evaluation_abort_reached_a_member():
    members = [m("a", "Completed", primary=True), m("b")]
    assert decide(members, budget_left=True, aborted=True) == Verdict.ABORT
