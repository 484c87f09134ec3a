"""The URL of one Redis database of the configured server: the test suites and each benchmark
keep to a database of their own."""

import os
from urllib.parse import urlsplit, urlunsplit


def redis_url(db: int, base: str | None = None) -> str:
    """Database `db` on the server of `base` (REDIS_URL by default), its other parts kept."""
    base = base or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return urlunsplit(urlsplit(base)._replace(path=f"/{db}"))
