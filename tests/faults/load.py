"""The fault suite's steady load, as a process of its own: clusters of 2 to 4 members (evaluations
and builds, some same-zone, retry budgets 0 to 2) and single jobs, submitted through the same
services as submit_cluster and submit_job, with the backlog of queued clusters kept bounded.
A database error (a PostgreSQL restart) is waited out. Stops on SIGTERM.

    python -m tests.faults.load --project faults [--seed N]
"""

import argparse
import os
import random
import signal
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")

MAX_QUEUED_CLUSTERS = 6
MAX_QUEUED_SINGLES = 10
PERIOD_SECS = 0.25


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    import django

    django.setup()
    from django.db import connection, transaction

    from clusters.models import ClusterJob, ClusterStatus
    from clusters.submission import MemberSpec, submit_cluster
    from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, Project
    from gradient.jobs.submission import JobSpec, create_jobs

    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    rng = random.Random(args.seed)
    Project.objects.get_or_create(name=args.project)

    def cluster() -> None:
        size = rng.randint(2, 4)
        members = [
            MemberSpec(
                role=rng.choice(("server", "client", "db")),
                job=JobSpec(kind=rng.choice(("eval", "build"))),
                primary=i == 0 and rng.random() < 0.3,
            )
            for i in range(size)
        ]
        submit_cluster(
            args.project,
            members,
            same_zone=rng.random() < 0.3,
            retry_budget=rng.randint(0, 2),
        )

    def singles() -> None:
        project = Project.objects.get(name=args.project)
        with transaction.atomic():
            create_jobs(project, [JobSpec(kind=rng.choice(("eval", "build")))])

    while not stop:
        try:
            queued = ClusterJob.objects.filter(status=ClusterStatus.QUEUED).count()
            if queued < MAX_QUEUED_CLUSTERS:
                cluster()
            waiting = (
                DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count()
                + Evaluation.objects.filter(status="Queued").count()
            )
            if waiting < MAX_QUEUED_SINGLES + 4 * queued:
                singles()
        except Exception as exc:  # PostgreSQL restarting: wait it out
            print(f"load: {exc!r}", flush=True)
            connection.close()
            time.sleep(0.5)
        time.sleep(PERIOD_SECS)
    connection.close()


if __name__ == "__main__":
    main()
