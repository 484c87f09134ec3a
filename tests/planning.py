"""Plain planner snapshots for the planner's tests: no database."""

from clusters import planner
from clusters.planner import Cluster, Member, Placement, Snapshot, Worker

X86 = "x86_64-linux"
ARM = "aarch64-linux"


def worker(
    id,
    *,
    zone=None,
    idle=("build",),
    arch=(X86,),
    features=(),
    projects=None,
    can_eval=True,
    can_build=True,
    name=None,
):
    return Worker(
        id=id,
        name=name or f"w{id}",
        zone=zone,
        idle_kinds=frozenset(idle),
        architectures=frozenset(arch),
        features=frozenset(features),
        projects=None if projects is None else frozenset(projects),
        can_eval=can_eval,
        can_build=can_build,
    )


def member(key, *, kind="build", pin=None, arch=X86, features=(), project=1, index=0):
    return Member(
        key=f"{kind}:{key}",
        kind=kind,
        role="node",
        index=index,
        pin=pin,
        architecture=arch,
        features=frozenset(features),
        project_id=project,
    )


def cluster(*members, id=1, same_zone=False):
    return Cluster(id=id, same_zone=same_zone, members=tuple(members))


def arrays(scores: dict[tuple[int, str], int]) -> dict:
    """Snapshot.score_arrays from flat scores, {(worker id, job key): missing_nar_size}."""
    by_job: dict[str, dict[int, int]] = {}
    for (worker_id, key), size in scores.items():
        by_job.setdefault(key, {})[worker_id] = size
    return planner.score_arrays(by_job)


def flat(snap: Snapshot) -> dict[tuple[int, str], int]:
    """The snapshot's scores as {(worker id, job key): missing_nar_size}."""
    return {
        (worker_id, key): size
        for key, (ids, sizes) in (snap.score_arrays or {}).items()
        for worker_id, size in zip(ids.tolist(), sizes.tolist(), strict=True)
    }


def snapshot(clusters, workers, scores=None):
    return Snapshot(
        clusters=tuple(clusters), workers=tuple(workers), score_arrays=arrays(scores or {})
    )


def names(placement: Placement) -> list[str]:
    return [seat.worker.name for seat in placement.seats]


def only(placements: list[Placement]) -> Placement:
    assert len(placements) == 1
    return placements[0]
