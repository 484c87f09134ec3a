"""submit_cluster: a member SPEC parsed into a MemberSpec, and the cluster created with its
member jobs in one transaction, from SPECs or a document (clusters.document).

SPEC is `ROLE:KIND[:primary][:pin=WORKER][:arch=ARCH][:features=F1+F2][:paths=P1+P2]`.
"""

from dataclasses import dataclass, replace

from django.db import transaction

from clusters.models import ClusterJob, ClusterMember
from clusters.wake import wake_dispatch
from gradient.jobs.models import JobKind, Project
from gradient.jobs.submission import (
    JobSpec,
    SubmissionError,
    column_range,
    create_jobs,
    split_plus,
)
from workers.models import Worker

ROLE_LIMIT = ClusterMember._meta.get_field("role").max_length
VALUED_OPTIONS = ("pin", "arch", "features", "paths")
_, RETRY_BUDGET_MAX = column_range(ClusterJob, "retry_budget")


@dataclass(frozen=True)
class MemberSpec:
    role: str
    job: JobSpec
    primary: bool = False
    pin: str | None = None  # a worker name


def check_role(role: str) -> None:
    if not role.strip():
        raise SubmissionError("empty role", "role")
    if len(role) > ROLE_LIMIT:
        raise SubmissionError(f"role is longer than {ROLE_LIMIT} characters", "role")


def parse_member(spec: str) -> MemberSpec:
    """One SPEC -> MemberSpec; SubmissionError names what is wrong with it."""
    role, sep, rest = spec.partition(":")
    if not sep:
        raise SubmissionError(f"member {spec!r}: expected ROLE:KIND[:option...]")
    try:
        check_role(role)
    except SubmissionError as e:
        raise SubmissionError(f"member {spec!r}: {e}") from None
    kind, *parts = rest.split(":")
    options: dict[str, str | None] = {}
    for part in parts:
        if not part:
            raise SubmissionError(f"member {spec!r}: empty option (two colons in a row?)")
        name, sep, value = part.partition("=")
        if name == "primary" and sep:
            raise SubmissionError(f"member {spec!r}: primary takes no value")
        if name in VALUED_OPTIONS and not (sep and value):
            raise SubmissionError(f"member {spec!r}: {name} needs a value ({name}=...)")
        if name != "primary" and name not in VALUED_OPTIONS:
            raise SubmissionError(f"member {spec!r}: unknown option {part!r}")
        if name in options:
            raise SubmissionError(f"member {spec!r}: {name} given more than once")
        options[name] = value if sep else None
    try:
        job = JobSpec(
            kind=kind,
            architecture=options.get("arch"),
            required_features=split_plus(options.get("features") or "", "features"),
            paths=split_plus(options.get("paths") or "", "paths"),
        )
    except SubmissionError as e:
        raise SubmissionError(f"member {spec!r}: {e}") from None
    return MemberSpec(role=role, job=job, primary="primary" in options, pin=options.get("pin"))


def check_members(members: list[MemberSpec]) -> None:
    """What no single SPEC can tell: there is a member, and at most one primary."""
    if not members:
        raise SubmissionError("a cluster needs at least one --member", "members")
    primaries = [m.role for m in members if m.primary]
    if len(primaries) > 1:
        raise SubmissionError(
            f"more than one primary member (roles {_names(primaries)})", "members"
        )


def check_pins(project: Project, members: list[MemberSpec]) -> None:
    """A pin that can never seat its member would leave the cluster waiting forever."""
    pins = [m.pin for m in members if m.pin is not None]

    def refuse(message: str, names: set[str]):
        first = next(i for i, m in enumerate(members) if m.pin in names)
        raise SubmissionError(f"{message}: {_names(names)}", f"members[{first}].pin")

    repeated = {p for p in pins if pins.count(p) > 1}
    if repeated:
        refuse("members sit on distinct workers; pinned twice", repeated)
    workers = {w.name: w for w in Worker.objects.filter(name__in=pins)}
    unknown = set(pins) - set(workers)
    if unknown:
        refuse("pin names unknown worker(s)", unknown)
    revoked = {n for n, w in workers.items() if w.revoked_at is not None}
    if revoked:
        refuse("pin names revoked worker(s)", revoked)
    barred = {n for n, w in workers.items() if not w.may_access(project.pk)}
    if barred:
        refuse(f"pinned worker(s) without access to project {project.name!r}", barred)


def submit_cluster(
    project: str,
    members: list[MemberSpec],
    *,
    same_zone: bool = False,
    retry_budget: int = 0,
    prioritized: bool = False,
) -> tuple[ClusterJob, list[ClusterMember]]:
    """Creates the member jobs, the cluster job (Queued) and its members in one transaction, all
    checked before the first write; the members in the order given. `prioritized` marks every
    member job, so the cluster is placed first."""
    check_members(members)
    if retry_budget < 0:
        raise SubmissionError(
            f"retry budget must not be negative, not {retry_budget}", "retry_budget"
        )
    if retry_budget > RETRY_BUDGET_MAX:
        raise SubmissionError(
            f"retry budget must be at most {RETRY_BUDGET_MAX}, not {retry_budget}", "retry_budget"
        )
    with transaction.atomic(durable=True):
        found = Project.objects.filter(name=project).first()
        if found is None:
            raise SubmissionError(f"unknown project {project!r}", "project")
        check_pins(found, members)

        specs = [replace(m.job, prioritized=m.job.prioritized or prioritized) for m in members]
        jobs = create_jobs(found, specs)
        cluster = ClusterJob.objects.create(
            project=found,
            same_zone=same_zone,
            retry_budget=retry_budget,
            prioritized=any(spec.prioritized for spec in specs),
        )
        # Inserted in SPEC order, so ids (and with them each role's indexes) follow it.
        rows = ClusterMember.objects.bulk_create(
            ClusterMember(
                cluster_job=cluster,
                role=m.role,
                primary=m.primary,
                pin=m.pin,
                **(
                    {"evaluation": job} if m.job.kind == JobKind.EVAL else {"derivation_build": job}
                ),
            )
            for m, job in zip(members, jobs, strict=True)
        )
        # A pass at once asks the idle workers that could seat it for their scores.
        transaction.on_commit(wake_dispatch)
    return cluster, rows


def _names(names) -> str:
    return ", ".join(map(repr, sorted(names)))
