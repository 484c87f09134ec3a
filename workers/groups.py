"""Reaching one worker's live session from any process: each session joins its worker's group
on the Channels layer."""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)


def worker_group(worker_id: int) -> str:
    return f"worker-{worker_id}"


def send_to_worker_on_commit(worker_id: int, message: dict) -> None:
    """Sends `message` to the worker's session once the current transaction commits, so nothing
    is announced that then rolls back. The layer carries only wake-ups: if it is unreachable the
    state is already in PostgreSQL, so log and go on."""

    def send():
        try:
            async_to_sync(get_channel_layer().group_send)(worker_group(worker_id), message)
        except Exception:
            logger.warning(
                "could not send %s to worker %s", message.get("type"), worker_id, exc_info=True
            )

    transaction.on_commit(send)


def close_revoked_on_commit(worker_id: int) -> None:
    """Asks a revoked worker's live connection to close; the session also re-checks its token."""
    send_to_worker_on_commit(worker_id, {"type": "worker.revoked"})


def send_frames(frames: list[tuple[int, object]]) -> None:
    """Sends protocol messages now (outside any transaction); best effort, like every send."""
    layer = get_channel_layer()

    async def send_all():
        for worker_id, frame in frames:
            await layer.group_send(
                worker_group(worker_id), {"type": "worker.send", "frame": frame.frame()}
            )

    try:
        async_to_sync(send_all)()
    except Exception:
        logger.warning("could not send %d frame(s)", len(frames), exc_info=True)
