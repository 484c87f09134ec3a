from django.core.management.base import CommandError
from django.db import transaction

from gradient.jobs.management.json_command import JsonCommand, Once
from gradient.jobs.models import JobKind, Project
from gradient.jobs.submission import JobSpec, SubmissionError, create_jobs, split_plus

# One transaction holds every job of a submission; a larger batch is a script's loop.
MAX_COUNT = 10_000


class Command(JsonCommand):
    help = 'Queue N single jobs in one transaction. Prints {"job_ids": [...]}.'

    def add_arguments(self, parser):
        parser.add_argument("--project", action=Once, required=True, metavar="P")
        parser.add_argument("--kind", action=Once, required=True, choices=JobKind.values)
        parser.add_argument("--arch", action=Once, metavar="ARCH")
        parser.add_argument("--features", action=Once, default="", metavar="F1+F2")
        parser.add_argument("--paths", action=Once, default="", metavar="P1+P2")
        parser.add_argument("--prioritized", action=Once, nargs=0, const=True, default=False)
        parser.add_argument(
            "--count", action=Once, type=int, default=1, metavar="N", help=f"1 to {MAX_COUNT}"
        )

    def run(self, *, project, kind, arch, features, paths, prioritized, count, **options):
        if not 1 <= count <= MAX_COUNT:
            raise CommandError(f"--count must be 1 to {MAX_COUNT}, not {count}")
        try:
            spec = JobSpec(
                kind=kind,
                architecture=arch,
                required_features=split_plus(features, "--features"),
                paths=split_plus(paths, "--paths"),
                prioritized=prioritized,
            )
        except SubmissionError as e:
            raise CommandError(str(e)) from None
        with transaction.atomic(durable=True):
            found = Project.objects.filter(name=project).first()
            if found is None:
                raise CommandError(f"unknown project {project!r}")
            jobs = create_jobs(found, [spec] * count)
        return {"job_ids": [job.job_key for job in jobs]}
