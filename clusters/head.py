"""The members at the head of the queue (protocol.md): what of the clusters waiting to start a
worker is offered, beside its single jobs (workers.head)."""

from clusters import statements
from gradient.jobs.models import JobKind
from gradient.wire.keys import job_key_sql
from workers.head import job_table, literals, offerable, window
from workers.statements import access_sql


def member_head_parts(worker, kinds=JobKind.values) -> list[str]:
    """The members' parts of each kind's head this worker could seat; a member evaluation
    always runs as one job, so a fetch-only worker has none of that kind."""
    parts = []
    for how in (offerable(worker, kind) for kind in kinds):
        if how is None or how.fetch_only:
            continue
        column = "evaluation_id" if how.kind == JobKind.EVAL else "derivation_build_id"
        for template in (statements.MEMBER_WALK, statements.PINNED_WALK):
            walk = template.format(
                table=job_table(how.kind),
                key=job_key_sql(how.kind, "x.id"),
                kind=how.kind,
                member_column=column,
                queued=literals(how.statuses[:1]),  # a member starts from Queued only
                window=window(),
                project_of_cluster="{project}",
            )
            archs = len(worker.architectures)
            part = access_sql(
                walk, statements.MEMBER_ORDER, window(), archs, project="c.project_id"
            )
            parts.append(statements.MEMBER_PART.format(part=part))
    return parts
