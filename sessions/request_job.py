"""Answering a RequestJob: the worker's head of the queue read (and offered), then the cheapest
job of it assigned, or an idle slot recorded and the dispatch pass woken."""

from clusters.head import member_head_parts
from clusters.statements import seat_reserved_sql
from clusters.wake import wake_dispatch
from gradient.jobs.models import JobKind
from workers import assignment, offers


def read_head(worker, offered: offers.Offered, kinds=JobKind.values) -> offers.Head:
    """The worker's head of these kinds, with the JobOffer of what it was not offered on this
    connection. A RequestJob reads its own kind's: what it scores is what the answer uses."""
    parts = member_head_parts(worker, kinds)
    return offers.offer_head(worker, offered, parts, kinds)


def answer_request(
    worker_id: int, kind: str, worker=None, head=None, sizes=None, resend: bool = False
):
    """The cheapest job of the worker's head; with nothing to give, an idle slot was recorded that
    may complete a placement, so the dispatch pass wakes (unless a pass has seen it already)."""
    reserved = seat_reserved_sql(kind)
    answer = assignment.request_job(worker_id, kind, worker, head, sizes, resend, reserved)
    if answer.wake:
        wake_dispatch()
    return answer.assign


def read_and_answer(worker, offered: offers.Offered, kind: str, resend: bool = False):
    """A RequestJob's head read and, when it holds nothing new to score, the answer too, in one
    call to the session's threads: the head, whether it was answered, and the AssignJob or None."""
    head = read_head(worker, offered, (kind,))
    if head.offer is not None:
        return head, False, None
    sizes = dict(offered.sizes)
    return head, True, answer_request(worker.pk, kind, worker, head.singles[kind], sizes, resend)
