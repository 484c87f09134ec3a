"""The simulated store: which paths a simulated worker already has and what the rest would cost
it to fetch, the same in every process, so a benchmark can compute any worker's scores."""

import hashlib
from collections.abc import Iterable

SIZE_UNIT = 1 << 20  # per-path NAR sizes are whole MiB, 1 to 1024 of them


def stable_hash(*parts: str) -> int:
    """A 64-bit hash that is the same in every process (unlike hash())."""
    digest = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def path_nar_size(path: str) -> int:
    """A path's NAR size: the same for every worker, so only which paths a worker has differs."""
    return (1 + stable_hash("size", path) % 1024) * SIZE_UNIT


def has_path(worker: str, path: str, fraction: float) -> bool:
    return stable_hash(worker, path) / 2**64 < fraction


def missing_cost(worker: str, paths: Iterable[str], fraction: float) -> tuple[int, int]:
    missing = [path for path in paths if not has_path(worker, path, fraction)]
    return len(missing), sum(map(path_nar_size, missing))
