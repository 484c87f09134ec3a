import uuid

from django.core.management.base import CommandError

from gradient.jobs.management.json_command import JsonCommand
from gradient.jobs.models import DispatchedJob


class Command(JsonCommand):
    help = (
        "Print what an assignment's report kept of its job's output:"
        ' {"assignment_id", "job_id", "worker", "outcome", "log_tail"}.'
    )

    def add_arguments(self, parser):
        parser.add_argument("assignment_id", metavar="ASSIGNMENT_ID")

    def run(self, *, assignment_id, **options):
        try:
            pk = uuid.UUID(assignment_id)
        except ValueError:
            raise CommandError(f"assignment id {assignment_id!r} is not a UUID") from None
        row = (
            DispatchedJob.objects.filter(pk=pk)
            .values("job_id", "worker__name", "outcome", "log_tail")
            .first()
        )
        if row is None:
            raise CommandError(f"unknown assignment {assignment_id}")
        return {
            "assignment_id": str(pk),
            "job_id": row["job_id"],
            "worker": row["worker__name"],
            "outcome": row["outcome"],
            "log_tail": row["log_tail"],
        }
