"""Running hypothesis against a live session: its examples are drawn on a thread of their
own, the session's coroutines run on the test's event loop."""

import asyncio

from channels.db import database_sync_to_async
from hypothesis import HealthCheck
from hypothesis import settings as fuzz_settings

SESSION = fuzz_settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def q(fn):
    return database_sync_to_async(fn)()  # closes its connection, as the consumer's calls do


class OnLoop:
    """Runs coroutines on the test's event loop from the thread hypothesis runs in."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()

    def __call__(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


async def send_raw(session, raw):
    if isinstance(raw, bytes):
        await session.ws.send_to(bytes_data=raw)
    else:
        await session.ws.send_to(text_data=raw)
