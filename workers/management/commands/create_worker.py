from django.core.management.base import CommandError
from django.db import IntegrityError, transaction
from django.utils import timezone

from gradient.jobs.management.json_command import JsonCommand, Once, checked_name
from gradient.jobs.models import Project
from gradient.wire.groups import close_revoked_on_commit
from workers.models import Worker, hash_token


class Command(JsonCommand):
    help = (
        'Create a worker and print its token, the only time it is shown: {"worker", "token"}.'
        ' With --revoke, revoke an existing worker instead: {"worker", "revoked": true}.'
    )

    def add_arguments(self, parser):
        parser.add_argument("name", metavar="NAME")
        parser.add_argument(
            "--projects",
            action=Once,
            metavar="P1,P2",
            help="only these projects (default: every project)",
        )
        parser.add_argument("--revoke", action=Once, nargs=0, const=True, default=False)

    def run(self, *, name, projects, revoke, **options):
        if revoke:
            if projects is not None:
                raise CommandError("--projects cannot be combined with --revoke")
            return self.revoke(name)
        return self.create(checked_name(Worker, name, "worker"), projects)

    def create(self, name: str, projects: str | None) -> dict:
        names = None if projects is None else set(projects.split(","))
        if names is not None and "" in names:
            raise CommandError(f"--projects {projects!r} has an empty project name")
        token = Worker.new_token()
        try:
            with transaction.atomic(durable=True):
                if Worker.objects.filter(name=name).exists():
                    raise CommandError(f"worker {name!r} already exists")
                allowed = []
                if names is not None:
                    allowed = list(Project.objects.filter(name__in=names))
                    missing = names - {p.name for p in allowed}
                    if missing:
                        raise CommandError(
                            f"unknown project(s): {', '.join(map(repr, sorted(missing)))}"
                        )
                worker = Worker.objects.create(
                    name=name, token_hash=hash_token(token), all_projects=names is None
                )
                worker.projects.set(allowed)
        except IntegrityError:  # created by someone else since the check
            raise CommandError(f"worker {name!r} already exists") from None
        return {"worker": name, "token": token}

    def revoke(self, name: str) -> dict:
        with transaction.atomic(durable=True):
            worker = Worker.objects.select_for_update().filter(name=name).first()
            if worker is None:
                raise CommandError(f"unknown worker {name!r}")
            if worker.revoked_at is not None:
                raise CommandError(f"worker {name!r} is already revoked")
            worker.revoked_at = timezone.now()
            worker.save(update_fields=["revoked_at"])
            close_revoked_on_commit(worker.id)
        return {"worker": name, "revoked": True}
