import json

from django.core.management.base import CommandError
from django.db import transaction

from gradient.jobs.management.json_command import JsonCommand, Once
from gradient.jobs.models import JobKind, Project
from gradient.jobs.submission import JobSpec, SubmissionError, create_jobs, split_plus

# One transaction holds every job of a submission; a larger batch is a script's loop.
MAX_COUNT = 10_000


def parse_command(value: str | None):
    """--command's JSON; what it must hold is JobSpec's to check."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as e:
        raise SubmissionError(f"not JSON ({e})", "command") from None


def parse_env(pairs: list[str]) -> dict[str, str]:
    """The --env NAME=VALUE options as one object."""
    env: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SubmissionError(f"{pair!r} is not NAME=VALUE", "env")
        if name in env:
            raise SubmissionError(f"{name} given more than once", "env")
        env[name] = value
    return env


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
        parser.add_argument(
            "--command", action=Once, metavar="JSON", help='what to run, as ["argv0", "arg", ...]'
        )
        parser.add_argument(
            "--env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="an extra environment variable of the command (repeatable)",
        )
        parser.add_argument(
            "--timeout-secs", action=Once, type=int, metavar="N", help="the command's time limit"
        )

    def run(
        self,
        *,
        project,
        kind,
        arch,
        features,
        paths,
        prioritized,
        count,
        command,
        env,
        timeout_secs,
        **options,
    ):
        if not 1 <= count <= MAX_COUNT:
            raise CommandError(f"--count must be 1 to {MAX_COUNT}, not {count}")
        try:
            spec = JobSpec(
                kind=kind,
                architecture=arch,
                required_features=split_plus(features, "--features"),
                paths=split_plus(paths, "--paths"),
                prioritized=prioritized,
                command=parse_command(command),
                env=parse_env(env),
                timeout_secs=timeout_secs,
            )
        except SubmissionError as e:
            # Named as the option that carried it: --arch, --command, --timeout-secs.
            field = e.field and "--" + e.field.replace("_", "-")
            raise CommandError(f"{field}: {e}" if field else str(e)) from None
        with transaction.atomic(durable=True):
            found = Project.objects.filter(name=project).first()
            if found is None:
                raise CommandError(f"unknown project {project!r}")
            jobs = create_jobs(found, [spec] * count)
        return {"job_ids": [job.job_key for job in jobs]}
