"""What one simulated worker can do and how it behaves."""

from collections.abc import Callable
from dataclasses import dataclass

from gradient.wire import protocol as p
from workers.client import ClientConfig

Scorer = Callable[[str, p.OfferedJob], tuple[int, int]]


@dataclass(frozen=True)
class WorkerConfig(ClientConfig):
    """What one simulated worker can do (its capabilities and connection, ClientConfig's) and
    how the simulation makes it behave."""

    job_secs: tuple[float, float] = (0.5, 2.0)  # a job runs for uniform(lo, hi) seconds
    fail_rate: float = 0.0  # chance a job ends in JobFailed{transient}
    reject_rate: float = 0.0  # chance a cluster member is refused
    # A flaky machine that loses its cluster members: on StartCluster it drops its connection
    # (and reconnects), so each member it held is lost with it.
    loses_members: bool = False
    have_fraction: float = 0.5  # share of offered paths the worker already has
    score: Scorer | None = None  # (worker name, offered job) -> (missing_count, missing_nar_size)
    score_secs: float = 0.0  # how long it takes to look at its store before it answers
    signal_on_start: bool = False  # on StartCluster, send one signal to every peer
    answers_members: bool = True  # False: a hung worker, holding members without a word
