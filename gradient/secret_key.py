"""The secret key of a checkout that was given none: made once, kept in a file git ignores.

A fixed fallback would be public, and would let anyone sign the admin's session cookies. Every
process of the checkout reads the same key, so sessions survive restarts.
"""

import os
import secrets
from pathlib import Path


def checkout_secret_key(path: Path) -> str:
    """The key in `path`, made there first if missing. Processes starting at once agree on
    one key: each writes its candidate to a file of its own and links it into place, which
    succeeds for the first only; the others then read the winner's whole file."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(50) + "\n")
    try:
        os.link(candidate, path)
    except FileExistsError:
        pass  # another process was first: its key is the checkout's
    finally:
        candidate.unlink()
    return path.read_text().strip()
