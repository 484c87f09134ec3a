"""Scores from the machine (protocol.md, "The agent"): a path /nix/store/H-N is present when
STORE/H-N exists; what an absent path would cost is the NarSize of CACHE/H.narinfo, a Nix
binary cache on disk, or 0 where the cache has none."""

from collections.abc import Iterable
from pathlib import Path

STORE_DIR = "/nix/store/"
MAX_SIZE = 2**63 - 1  # what a score may say (a bigint); a corrupt narinfo cannot break the answer


def store_name(path: str) -> str | None:
    """H-N of /nix/store/H-N (or of a path inside it); None for what names no store entry."""
    name = path.removeprefix(STORE_DIR).split("/", 1)[0]
    return name if name not in ("", ".", "..") else None


def nar_size(cache: Path | None, name: str) -> int:
    """The NarSize line of the path's narinfo in the cache, 0 where there is none."""
    if cache is None:
        return 0
    narinfo = cache / f"{name.split('-', 1)[0]}.narinfo"
    try:
        text = narinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "NarSize":
            value = value.strip()
            return int(value) if value.isascii() and value.isdigit() else 0
    return 0


def missing_cost(paths: Iterable[str], store: Path, cache: Path | None) -> tuple[int, int]:
    """(missing_count, missing_nar_size) of these paths on this machine."""
    count = size = 0
    for path in paths:
        name = store_name(path)
        if name is not None and (store / name).exists():
            continue
        count += 1
        size += nar_size(cache, name) if name is not None else 0
    return count, min(size, MAX_SIZE)
