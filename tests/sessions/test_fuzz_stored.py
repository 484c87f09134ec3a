"""Fuzzing what the parser lets through to the database: capabilities and scores with
extreme values reach their rows as sent, or are refused with bad_message; the session
survives every frame.
"""

import asyncio
import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.wire.protocol import INBOUND, ProtocolError, WorkerCapabilities
from tests.sessions.bad_frames import huge_ints, long_text, nul_text, odd_text, parse_or_error
from tests.sessions.fuzz_harness import SESSION, OnLoop, q
from tests.sessions.schema_strategies import set_at, slots, valid, valid_frames


@st.composite
def extreme_frames(draw):
    """Frames the server stores from: capabilities and scores with big ints, long strings,
    NULs, astral characters, and repeated jobs in one JobScores."""
    name, data = draw(valid_frames(("WorkerCapabilities", "JobScores")))
    data = copy.deepcopy(data)
    targets = [s for s in slots(INBOUND[name], data) if s.type in (int, str)]
    chosen = draw(st.lists(st.sampled_from(targets), max_size=3)) if targets else []
    for slot in chosen:
        if slot.type is int:
            value = draw(huge_ints.filter(lambda v: v >= 0) | valid(slot.annotation, slot.metadata))
        elif slot.bounds.pattern and "eval|build" in slot.bounds.pattern:
            continue  # job keys: fuzzed by the mutations
        else:
            value = draw(long_text | odd_text | nul_text)
        set_at(data, slot.path, value)
    if name == "JobScores" and data["scores"] and draw(st.booleans()):
        data["scores"].append({**data["scores"][0], "missing_count": 7})
    return {"type": name, **data}


def sent(message):
    if isinstance(message, WorkerCapabilities):
        return message.model_dump(exclude={"running"})  # the session's, not the worker row's
    return {s.job_id: (s.missing_count, s.missing_nar_size) for s in message.scores}


def stored(worker_id, message):
    from workers.models import JobScore, Worker

    if isinstance(message, WorkerCapabilities):
        w = Worker.objects.get(pk=worker_id)
        return {
            "architectures": w.architectures,
            "system_features": w.system_features,
            "max_concurrent_builds": w.max_concurrent_builds,
            "max_concurrent_evals": w.max_concurrent_evals,
            "eval": w.can_eval,
            "build": w.can_build,
            "fetch": w.can_fetch,
            "zone": w.zone,
            "endpoint": w.endpoint,
        }
    rows = JobScore.objects.filter(
        worker_id=worker_id, job_id__in=[s.job_id for s in message.scores]
    ).values_list("job_id", "missing_count", "missing_nar_size")
    return {job: (count, size) for job, count, size in rows}


@pytest.mark.asyncio
async def test_frames_the_parser_accepts_never_crash_the_session(worker_session, settings):
    """What the parser lets through reaches the database: it must fit there, or be refused
    with bad_message like any malformed frame."""
    settings.GRADIENT = {
        **settings.GRADIENT,
        "WORKER_RATE_PER_SEC": 100_000,
        "WORKER_RATE_BURST": 100_000,
    }
    worker, session = await worker_session()
    assert (await session.connect())[0]
    await session.hello()
    on_loop = OnLoop()

    async def handle_all(frames):
        for frame in frames:
            raw = json.dumps(frame)
            message = parse_or_error(raw)
            await session.send(raw)
            if isinstance(message, ProtocolError):
                reply = await session.recv()
                assert (reply["type"], reply["code"]) == ("Error", "bad_message"), reply
                continue
            if frame["type"] == "WorkerCapabilities":
                assert (await session.recv_type("InitAck"))["worker"] == worker.name
                assert await q(lambda m=message: stored(worker.pk, m)) == sent(message)
                for job in message.running:  # none of them is this worker's: abort each
                    assert (await session.recv_type("AbortJob"))["job_id"] == job.job_id
                continue
            # JobScores has no answer, and waits in the session's queue for offers and
            # requests: stored as sent once handled, nothing cut short on the way in.
            for _ in range(200):
                if await q(lambda m=message: stored(worker.pk, m)) == sent(message):
                    break
                await asyncio.sleep(0.025)
            assert await q(lambda m=message: stored(worker.pk, m)) == sent(message)
        await session.hello()  # answered: the session survived every frame

    @SESSION
    @given(st.lists(extreme_frames(), min_size=1, max_size=4))
    def handled(frames):
        on_loop(handle_all(frames))

    await asyncio.to_thread(handled)
    await session.close()
