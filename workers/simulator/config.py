"""What one simulated worker can do and how it behaves."""

from collections.abc import Callable
from dataclasses import dataclass

from gradient.wire import protocol as p

Scorer = Callable[[str, p.OfferedJob], tuple[int, int]]


@dataclass(frozen=True)
class WorkerConfig:
    """What one simulated worker can do and how it behaves. Capabilities go to the server as
    they are; the rest shapes the simulation."""

    architectures: tuple[str, ...] = ("x86_64-linux",)
    system_features: tuple[str, ...] = ()
    max_builds: int = 1
    max_evals: int = 1
    eval: bool = True
    build: bool = True
    fetch: bool = False
    zone: str | None = None
    endpoint: str | None = None
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
    heartbeat_secs: float | None = None  # overrides InitAck's, so tests need not wait 10 s
    backoff: tuple[float, float] = (0.1, 2.0)  # reconnect delay: first, cap
    # A 403 at the handshake is a refused token (protocol.md), but daphne also answers 403 to a
    # handshake its application did not accept in time (an overloaded server). So a 403 is
    # tried again this many times, after this long (doubling, jittered: 5 s to 80 s, about
    # 2.5 min in all), before the worker stops for good; a revoked worker costs the server a
    # few handshakes, and a worker refused by a server busy with a restart is soon back.
    forbidden_retries: int = 5
    forbidden_backoff: float = 5.0
    open_timeout: float = 10.0
    max_events: int | None = 1000  # events kept in memory (the log file keeps them all)
    seed: int | None = None  # with a seed, durations, failures and rejects are reproducible

    def slots(self, kind: str) -> int:
        if kind == "eval":
            return self.max_evals if (self.eval or self.fetch) else 0
        return self.max_builds if self.build else 0
