import factory
from django.utils import timezone

from clusters.models import ClusterJob, ClusterMember
from gradient.jobs.models import BuildStatus, DerivationBuild, Evaluation, Project
from workers.models import JobScore, Worker, hash_token


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"project-{n}")


class EvaluationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Evaluation

    project = factory.SubFactory(ProjectFactory)


class BuildFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = DerivationBuild

    project = factory.SubFactory(ProjectFactory)
    status = BuildStatus.QUEUED


class WorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Worker
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"worker-{n}")
    token_hash = factory.LazyAttribute(lambda o: hash_token(f"token-{o.name}"))
    architectures = factory.LazyFunction(lambda: ["x86_64-linux"])
    max_concurrent_builds = 1
    max_concurrent_evals = 1
    can_eval = True
    can_build = True
    can_fetch = True


class ClusterFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterJob

    project = factory.SubFactory(ProjectFactory)


class EvalMemberFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterMember

    cluster_job = factory.SubFactory(ClusterFactory)
    evaluation = factory.SubFactory(
        EvaluationFactory, project=factory.SelfAttribute("..cluster_job.project")
    )
    role = "server"


class BuildMemberFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClusterMember

    cluster_job = factory.SubFactory(ClusterFactory)
    derivation_build = factory.SubFactory(
        BuildFactory, project=factory.SelfAttribute("..cluster_job.project")
    )
    role = "client"


def answered_scores(triples) -> None:
    """job_score rows as a worker's JobScores answer leaves them: (worker, job key, size)."""
    now = timezone.now()
    JobScore.objects.bulk_create(
        JobScore(
            worker=worker,
            job_id=key,
            offered_at=now,
            scored_at=now,
            missing_count=1,
            missing_nar_size=size,
        )
        for worker, key, size in triples
    )


def waiting(*members):
    """The clusters of these members as a dispatch pass leaves them when it cannot place them
    yet: waiting to start, their members at the head of the queue."""
    ClusterJob.objects.filter(pk__in=[m.cluster_job_id for m in members]).update(
        waiting_since=timezone.now()
    )
    return members[0] if len(members) == 1 else members
