"""What a worker tells the server it can do, and how it keeps its connection."""

from dataclasses import dataclass

from gradient.wire import protocol as p


@dataclass(frozen=True)
class ClientConfig:
    """A worker's capabilities (sent as they are in WorkerCapabilities) and its connection's
    behaviour: heartbeat, reconnect backoff, refusals at the handshake, TLS."""

    architectures: tuple[str, ...] = ("x86_64-linux",)
    system_features: tuple[str, ...] = ()
    max_builds: int = 1
    max_evals: int = 1
    eval: bool = True
    build: bool = True
    fetch: bool = False
    zone: str | None = None
    endpoint: str | None = None
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
    ca_file: str | None = None  # a wss:// server is verified against these CAs, else the system's
    max_events: int | None = 1000  # events kept in memory (a log keeps them all)
    seed: int | None = None  # with a seed, the worker's random draws are reproducible

    def slots(self, kind: str) -> int:
        if kind == "eval":
            return self.max_evals if (self.eval or self.fetch) else 0
        return self.max_builds if self.build else 0

    def capabilities(self) -> p.WorkerCapabilities:
        return p.WorkerCapabilities(
            architectures=list(self.architectures),
            system_features=list(self.system_features),
            max_concurrent_builds=self.max_builds,
            max_concurrent_evals=self.max_evals,
            eval=self.eval,
            build=self.build,
            fetch=self.fetch,
            zone=self.zone,
            endpoint=self.endpoint,
        )
