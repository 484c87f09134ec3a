from django.core.management.base import CommandError

from gradient.jobs.management.json_command import JsonCommand, Once
from workers import health
from workers.models import Worker


class Command(JsonCommand):
    help = (
        "Quarantine a worker from cluster members until released (single jobs still reach it),"
        ' or with --release lift its quarantine, automatic or not: {"worker", "quarantined"}.'
    )

    def add_arguments(self, parser):
        parser.add_argument("name", metavar="NAME")
        parser.add_argument("--reason", action=Once, metavar="TEXT")
        parser.add_argument("--release", action=Once, nargs=0, const=True, default=False)

    def run(self, *, name, reason, release, **options):
        if release and reason is not None:
            raise CommandError("--reason cannot be combined with --release")
        limit = Worker._meta.get_field("quarantine_reason").max_length
        if reason is not None and len(reason) > limit:
            raise CommandError(f"--reason is longer than {limit} characters")
        worker = Worker.objects.filter(name=name).first()
        if worker is None:
            raise CommandError(f"unknown worker {name!r}")
        if release:
            health.release(worker)
        else:
            health.quarantine(worker, reason or None)
        return {"worker": name, "quarantined": not release}
