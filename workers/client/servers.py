"""The servers a worker connects to: their URLs, tried in turn, and how a wss:// one is
verified."""

import ssl
from collections.abc import Sequence

DEFAULT_URL = "ws://127.0.0.1:8000/proto"
REPLACED_CLOSE_CODE = 4409  # a second connection with the same token took this one's place


def rotated(urls: list[str], start: int) -> list[str]:
    start %= len(urls)
    return urls[start:] + urls[:start]


def server_urls(url: str | Sequence[str]) -> list[str]:
    """One URL, or several: the servers to try in turn."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("at least one server URL is needed")
    return urls


class Verifier:
    """The TLS context of wss:// URLs (the system's CAs, or only those of ca_file), made
    once; None for ws://."""

    def __init__(self, ca_file: str | None):
        self.ca_file = ca_file
        self._context: ssl.SSLContext | None = None

    def context_for(self, url: str) -> ssl.SSLContext | None:
        if not url.startswith("wss://"):
            return None
        if self._context is None:
            self._context = ssl.create_default_context(cafile=self.ca_file)
        return self._context
