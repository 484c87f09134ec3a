"""Fuzzing the worker protocol: hypothesis strategies derived from the schemas of
gradient.wire.protocol, over every message, plus arbitrary JSON, text and bytes.

The parser: it returns a message of the frame's class or raises ProtocolError with a message,
never anything else; valid frames parse back equal, unknown fields are ignored, a dropped or
mistyped field is refused. The session: every refused frame is answered with Error
bad_message or not_allowed, the socket stays open and the database is exactly as it was.
"""

import asyncio
import copy
import json
import re
import types
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from channels.db import database_sync_to_async
from django.apps import apps
from hypothesis import HealthCheck, event, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st
from pydantic import BaseModel, StringConstraints
from pydantic.fields import FieldInfo

from gradient.wire.keys import JOB_KEY_PATTERN
from gradient.wire.protocol import (
    INBOUND,
    OUTBOUND,
    Message,
    ProtocolError,
    WorkerCapabilities,
    parse_inbound,
    parse_outbound,
)

PARSER = fuzz_settings(max_examples=250, deadline=None)
SESSION = fuzz_settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# Schema -> strategies. Every field type of protocol.py maps to a JSON kind and a strategy of
# valid JSON values; an unknown field type fails loudly here rather than go unfuzzed.

JSON_KINDS = ("null", "bool", "int", "float", "string", "array", "object")

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
OF_KIND = {
    "null": st.none(),
    "bool": st.booleans(),
    "int": st.integers(),
    "float": st.sampled_from([0.0, 1.0, -1.0, 0.5, -2.5, 1e-9, 1e300]),
    "string": st.text(max_size=16),
    "array": st.lists(json_values, max_size=3),
    "object": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
}


def unwrap(annotation, metadata=()):
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        metadata = (*metadata, *extra)
    return annotation, tuple(metadata)


def is_model(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def is_union(t) -> bool:
    return get_origin(t) in (Union, types.UnionType)


@dataclass(frozen=True)
class Bounds:
    ge: int | None = None
    le: int | None = None
    pattern: str | None = None
    max_length: int | None = None

    def admits(self, value) -> bool:
        if isinstance(value, int):
            return (self.ge is None or value >= self.ge) and (self.le is None or value <= self.le)
        return (self.pattern is None or re.fullmatch(self.pattern, value) is not None) and (
            self.max_length is None or len(value) <= self.max_length
        )


def bounds(metadata) -> Bounds:
    found = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            found.update({k: v for k, v in vars(bounds(m.metadata)).items() if v is not None})
        elif isinstance(m, annotated_types.Ge):
            found["ge"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            found["ge"] = m.gt + 1
        elif isinstance(m, annotated_types.Le):
            found["le"] = m.le
        elif isinstance(m, annotated_types.Lt):
            found["le"] = m.lt - 1
        elif isinstance(m, annotated_types.MaxLen):
            found["max_length"] = m.max_length
        elif isinstance(m, StringConstraints):
            if m.pattern is not None:
                found["pattern"] = m.pattern
            if m.max_length is not None:
                found["max_length"] = m.max_length
    return Bounds(**{k: v for k, v in found.items() if v is not None})


def kinds(annotation) -> frozenset | None:
    """The JSON kinds a slot accepts; None for any value."""
    t, _ = unwrap(annotation)
    if t is Any:
        return None
    if t is type(None):
        return frozenset({"null"})
    if is_union(t):
        parts = [kinds(a) for a in get_args(t)]
        return None if None in parts else frozenset().union(*parts)
    if get_origin(t) is Literal:
        assert all(isinstance(v, str) for v in get_args(t))
        return frozenset({"string"})
    if get_origin(t) is list:
        return frozenset({"array"})
    if is_model(t):
        return frozenset({"object"})
    known = {bool: "bool", int: "int", str: "string"}
    if t in known:
        return frozenset({known[t]})
    raise TypeError(f"no JSON kind for {t!r}: teach test_fuzz about it")


def key(name: str, info: FieldInfo) -> str:
    alias = info.validation_alias
    return alias if isinstance(alias, str) else name


def valid(annotation, metadata=()) -> st.SearchStrategy:
    """JSON values the slot accepts."""
    t, meta = unwrap(annotation, metadata)
    b = bounds(meta)
    if t is Any:
        return json_values
    if t is type(None):
        return st.none()
    if is_union(t):
        return st.one_of([valid(a) for a in get_args(t)])
    if get_origin(t) is Literal:
        return st.sampled_from(get_args(t))
    if get_origin(t) is list:
        return st.lists(valid(get_args(t)[0]), max_size=3)
    if t is bool:
        return st.booleans()
    if t is int:
        return st.integers(min_value=b.ge, max_value=b.le)
    if t is str:
        text = st.from_regex(b.pattern, fullmatch=True) if b.pattern else st.text(max_size=16)
        return text.filter(b.admits) if b.max_length is not None else text
    if is_model(t):
        return objects(t)
    raise TypeError(f"no strategy for {t!r}: teach test_fuzz about it")


def objects(model: type[BaseModel]) -> st.SearchStrategy:
    """A valid JSON object for the model (without "type"); optional fields may be absent."""
    required, optional = {}, {}
    for name, info in model.model_fields.items():
        (required if info.is_required() else optional)[key(name, info)] = valid(
            info.annotation, info.metadata
        )
    return st.fixed_dictionaries(required, optional=optional)


def dumped(annotation, value):
    """What model_dump(mode="json") gives back for a valid JSON value of the slot."""
    t, _ = unwrap(annotation)
    if is_union(t):
        model = model_of(t)
        return dumped(model, value) if model and isinstance(value, dict) else value
    if get_origin(t) is list:
        return [dumped(get_args(t)[0], v) for v in value]
    if is_model(t):
        out = {}
        for name, info in t.model_fields.items():
            k = key(name, info)
            out[name] = dumped(info.annotation, value[k]) if k in value else info.get_default()
        return out
    return value


@dataclass
class Slot:
    """A place in a frame that the schema types: a model's field or a list's item."""

    path: tuple
    annotation: Any
    metadata: tuple = ()
    info: FieldInfo | None = None  # a model field, which may be dropped

    @property
    def type(self):
        return unwrap(self.annotation, self.metadata)[0]

    @property
    def bounds(self) -> Bounds:
        return bounds(unwrap(self.annotation, self.metadata)[1])


def slots(model, data, path=()):
    for name, info in model.model_fields.items():
        k = key(name, info)
        yield Slot((*path, k), info.annotation, tuple(info.metadata), info)
        if k in data:
            yield from inner_slots(info.annotation, data[k], (*path, k))


def model_of(annotation) -> type[BaseModel] | None:
    t, _ = unwrap(annotation)
    options = [unwrap(a)[0] for a in get_args(t)] if is_union(t) else [t]
    return next((m for m in options if is_model(m)), None)


def inner_slots(annotation, value, path):
    t, _ = unwrap(annotation)
    if get_origin(t) is list and isinstance(value, list):
        item = get_args(t)[0]
        for i, v in enumerate(value):
            yield Slot((*path, i), item)
            yield from inner_slots(item, v, (*path, i))
    elif (model := model_of(t)) is not None and isinstance(value, dict):
        yield from slots(model, value, path)


def field_keys(model) -> set[str]:
    return {key(n, i) for n, i in model.model_fields.items()}


def objects_at(model, data):
    """Paths of the JSON objects in a frame that a model reads (each ignores unknown keys)."""
    yield (), field_keys(model)
    for slot in slots(model, data):
        try:
            value = get_at(data, slot.path)
        except (KeyError, IndexError):
            continue
        if (inner := model_of(slot.annotation)) is not None and isinstance(value, dict):
            yield slot.path, field_keys(inner)


def get_at(data, path):
    for step in path:
        data = data[step]
    return data


def set_at(data, path, value):
    get_at(data, path[:-1])[path[-1]] = value


def drop_at(data, path):
    del get_at(data, path[:-1])[path[-1]]


@dataclass
class Case:
    """A frame and what the parser must make of it."""

    frame: dict
    expect: str  # "accept" (parses to `name` with `dump`), "reject", or "either"
    name: str
    dump: dict | None = None
    how: str = ""


long_text = st.text(min_size=65, max_size=3000)
odd_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)  # astral, controls
nul_text = st.tuples(st.text(max_size=8), st.text(max_size=8)).map(lambda p: f"{p[0]}\x00{p[1]}")
huge_ints = (
    st.integers(min_value=2**31 - 2)
    | st.integers(max_value=-(2**31))
    | st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**40, -(2**63) - 1])
)
UNKNOWN_TYPES = st.one_of(
    st.sampled_from(sorted(set(OUTBOUND) - set(INBOUND))),
    st.sampled_from(sorted(INBOUND)).map(str.lower),
    st.sampled_from(sorted(INBOUND)).map(lambda n: f"{n} "),
    st.sampled_from(sorted(INBOUND)).map(lambda n: f" {n}"),
    st.sampled_from(["", "type", "__class__", "Message", "on_Draining", "Score", "MemberRef"]),
    st.text(max_size=20),
).filter(lambda n: n not in INBOUND)
INBOUND_NAMES = tuple(sorted(INBOUND))
MUTATIONS = ("drop", "wrong_type", "null", "negative", "huge", "text", "type", "swap_type")


@st.composite
def valid_frames(draw, names=INBOUND_NAMES):
    name = draw(st.sampled_from(names))
    return name, draw(objects(INBOUND[name]))


@st.composite
def mutated(draw, names=INBOUND_NAMES, mutations=MUTATIONS, extra=True):
    """A valid frame with one mutation, maybe plus unknown fields (which change nothing)."""
    name, data = draw(valid_frames(names))
    model = INBOUND[name]
    data = copy.deepcopy(data)
    expect, how = "accept", draw(st.sampled_from(mutations))
    slot_list = list(slots(model, data))

    def pick(ok):
        fitting = [s for s in slot_list if ok(s)]
        return draw(st.sampled_from(fitting)) if fitting else None

    frame_type: Any = name
    if how == "drop" and (s := pick(lambda s: s.info and s.path[-1] in get_at(data, s.path[:-1]))):
        drop_at(data, s.path)
        expect = "reject" if s.info.is_required() else "accept"
    elif how == "wrong_type" and (s := pick(lambda s: kinds(s.annotation) is not None)):
        wrong = sorted(set(JSON_KINDS) - kinds(s.annotation))
        set_at(data, s.path, draw(st.sampled_from(wrong).flatmap(OF_KIND.get)))
        expect = "reject"
    elif how == "null" and (s := pick(lambda s: "null" not in (kinds(s.annotation) or {"null"}))):
        set_at(data, s.path, None)
        expect = "reject"
    elif how == "negative" and (s := pick(lambda s: s.type is int and s.bounds.ge is not None)):
        set_at(data, s.path, draw(st.integers(max_value=s.bounds.ge - 1)))
        expect = "reject"
    elif how == "huge" and (s := pick(lambda s: s.type is int)):
        value = draw(huge_ints)
        set_at(data, s.path, value)
        expect = "accept" if s.bounds.admits(value) else "reject"
    elif how == "text" and (s := pick(lambda s: s.type is str or get_origin(s.type) is Literal)):
        value = draw(long_text | odd_text | nul_text)
        set_at(data, s.path, value)
        if get_origin(s.type) is Literal:
            expect = "accept" if value in get_args(s.type) else "reject"
        else:
            expect = "accept" if s.bounds.admits(value) else "reject"
    elif how == "type":
        frame_type = draw(st.just(None) | UNKNOWN_TYPES | OF_KIND["int"] | OF_KIND["array"])
        expect = "reject"
    elif how == "swap_type":
        frame_type = name = draw(st.sampled_from(sorted(INBOUND)))
        expect = "either"
    else:
        how = "none"
    if extra:
        for path, known in draw(st.lists(st.sampled_from(list(objects_at(model, data))))):
            taken = known | ({"type"} if path == () else set())
            extras = st.dictionaries(
                st.text(max_size=10).filter(lambda k, t=taken: k not in t), json_values, max_size=3
            )
            get_at(data, path).update(draw(extras))
    frame = {"type": frame_type, **data} if frame_type is not None else data
    dump = dumped(model, data) if expect == "accept" else None
    return Case(frame, expect, name, dump, how)


def encoded(frame, how: str) -> str | bytes:
    if how == "bytes":
        return json.dumps(frame, ensure_ascii=False).encode()
    return json.dumps(frame, ensure_ascii=how == "ascii")


def parse_or_error(raw) -> Message | ProtocolError:
    """The property every input must keep: a message of an inbound class, or ProtocolError
    with something to say. Any other exception fails the test."""
    try:
        message = parse_inbound(raw)
    except ProtocolError as exc:
        assert isinstance(str(exc), str) and str(exc).strip(), repr(exc)
        return exc
    assert type(message) in INBOUND.values(), message
    return message


# (1) The parser alone: no database, many examples


@PARSER
@given(valid_frames(), st.sampled_from(["ascii", "utf8", "bytes"]))
def test_every_valid_inbound_message_parses_back_equal(case, encoding):
    name, data = case
    message = parse_or_error(encoded({"type": name, **data}, encoding))
    assert type(message) is INBOUND[name], message
    assert message.model_dump(mode="json") == dumped(INBOUND[name], data)
    assert parse_inbound(message.frame()) == message


@pytest.mark.parametrize("how", MUTATIONS)
@fuzz_settings(max_examples=60, deadline=None)
@given(data=st.data(), encoding=st.sampled_from(["ascii", "utf8", "bytes"]))
def test_a_mutated_inbound_message_is_refused_or_parsed_as_the_schema_says(how, data, encoding):
    case = data.draw(mutated(mutations=(how,)), "case")
    event(case.how)
    result = parse_or_error(encoded(case.frame, encoding))
    if case.expect == "reject":
        assert isinstance(result, ProtocolError), result
    elif case.expect == "accept":
        assert type(result) is INBOUND[case.name], result
        assert result.model_dump(mode="json") == case.dump
    else:
        assert isinstance(result, ProtocolError | INBOUND[case.name]), result


@st.composite
def shaped_frames(draw):
    """A known type with that message's field names bound to arbitrary JSON values."""
    name = draw(st.sampled_from(sorted(INBOUND)))
    names = [key(n, i) for n, i in INBOUND[name].model_fields.items()]
    body = draw(st.dictionaries(st.sampled_from(names), json_values)) if names else {}
    return {"type": name, **body}


@st.composite
def damaged_text(draw):
    """A valid frame's text, cut short or with a character changed."""
    name, data = draw(valid_frames())
    text = json.dumps({"type": name, **data})
    at = draw(st.integers(0, len(text) - 1))
    if draw(st.booleans()):
        return text[:at]
    return text[:at] + draw(st.characters()) + text[at + 1 :]


@PARSER
@given(
    st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300),
        damaged_text(),
        damaged_text().map(str.encode),
        json_values.map(json.dumps),
        st.dictionaries(st.sampled_from(["type", "kind", "job_id"]), json_values).map(json.dumps),
    )
)
def test_arbitrary_bytes_and_text_never_raise_anything_but_protocol_error(raw):
    parse_or_error(raw)


@PARSER
@given(shaped_frames() | OF_KIND["object"])
def test_arbitrary_json_objects_parse_to_their_own_type_or_are_refused(frame):
    result = parse_or_error(json.dumps(frame))
    if not isinstance(result, ProtocolError):
        assert type(result) is INBOUND[frame["type"]]


@PARSER
@given(
    st.sampled_from(sorted(OUTBOUND)).flatmap(lambda n: objects(OUTBOUND[n]).map(lambda d: (n, d)))
)
def test_every_outbound_message_round_trips_through_its_frame(case):
    name, data = case
    message = OUTBOUND[name].model_validate(data)
    back = parse_outbound(message.frame())
    assert type(back) is OUTBOUND[name] and back == message


def test_the_strategies_cover_every_message_and_field_type():
    """A message or a field type the strategies could not build fails here, not silently."""
    for model in (*INBOUND.values(), *OUTBOUND.values()):
        assert objects(model) is not None  # built eagerly: an unknown field type raises
        for info in model.model_fields.values():
            assert kinds(info.annotation) is None or kinds(info.annotation) <= set(JSON_KINDS)


# (2) The session: refused frames through the consumer, on the real database


def q(fn):
    return database_sync_to_async(fn)()  # closes its connection, as the consumer's calls do


SNAPSHOT_APPS = ("jobs", "workers", "clusters")
VOLATILE = {"last_seen_at"}  # liveness: any frame may refresh it


def snapshot():
    """Every row of the scheduler's tables, but liveness."""
    state = {}
    for label in SNAPSHOT_APPS:
        for model in apps.get_app_config(label).get_models():
            rows = model.objects.order_by("pk").values()
            state[model._meta.label] = [
                {k: v for k, v in row.items() if k not in VOLATILE} for row in rows
            ]
    return state


@dataclass
class World:
    """A capabilities-acked session holding one build and an idle eval slot, a session that
    never sent WorkerCapabilities, a queued build, a single build held by another worker, and
    a started cluster attempt of two other workers."""

    fuzzer: Any
    newcomer: Any
    held: tuple[str, str]
    queued: str
    others: list[tuple[str, str]]
    attempt: str

    @property
    def job_ids(self):
        return [self.held[0], self.queued, *(j for j, _ in self.others)]

    @property
    def assignment_ids(self):
        return [self.held[1], *(a for _, a in self.others)]

    def allowed(self, frame) -> bool:
        """Would the fuzzer's session act on this well-formed frame?"""
        same_job = frame.get("job_id", "").lower() == self.held[0].lower()
        if frame["type"] == "AssignJobResponse":
            return same_job
        if frame["type"] in ("JobCompleted", "JobFailed"):
            return same_job and uuid.UUID(frame["assignment_id"]) == uuid.UUID(self.held[1])
        return False


def other_workers_state():
    from clusters import coordinator
    from clusters.dispatch import run_pass
    from clusters.models import ClusterAttempt
    from gradient.jobs.models import DispatchedJob
    from tests.clusterflow import idle_workers
    from tests.factories import (
        BuildFactory,
        BuildMemberFactory,
        ClusterFactory,
        EvalMemberFactory,
        WorkerFactory,
    )
    from workers import assignment

    cluster = ClusterFactory()
    EvalMemberFactory(cluster_job=cluster, role="server")
    BuildMemberFactory(cluster_job=cluster, role="client")
    idle_workers(2)
    assert run_pass().claimed == [cluster.pk]
    members = list(DispatchedJob.objects.filter(cluster_attempt__cluster_job=cluster))
    for row in members:
        coordinator.accept_assignment(row.worker_id, row.job_id)
    attempt = ClusterAttempt.objects.get(cluster_job=cluster)
    assert attempt.started_at is not None and attempt.finished_at is None
    other = WorkerFactory(name="other")
    BuildFactory()
    single = assignment.request_job(other.pk, "build")
    assert single is not None
    others = [(single.job_id, single.assignment_id), *((r.job_id, str(r.pk)) for r in members)]
    return others, str(attempt.pk)


async def build_world(make) -> World:
    from tests.factories import BuildFactory
    from workers.assignment import record_idle

    others, attempt = await q(other_workers_state)
    fuzzer_worker, fuzzer = await make(name="fuzzer")
    _, newcomer = await make(name="newcomer")
    await q(lambda: BuildFactory.create_batch(2))
    assert (await fuzzer.connect())[0]
    await fuzzer.hello()
    offer = await fuzzer.recv_type("JobOffer")
    await fuzzer.send({"type": "RequestJob", "kind": "build"})
    held = await fuzzer.recv_type("AssignJob")
    (queued,) = [j["job_id"] for j in offer["jobs"] if j["job_id"] != held["job_id"]]
    # Scored offers stay across a repeated WorkerCapabilities, so re-sending it changes nothing.
    scores = [
        {"job_id": j["job_id"], "missing_count": 1, "missing_nar_size": 2} for j in offer["jobs"]
    ]
    await fuzzer.send({"type": "JobScores", "scores": scores})
    await q(lambda: record_idle(fuzzer_worker.pk, "eval"))
    await fuzzer.hello()  # frames are handled in order: the scores are stored now
    assert (await newcomer.connect())[0]
    return World(fuzzer, newcomer, (held["job_id"], held["assignment_id"]), queued, others, attempt)


def rejected(raw) -> bool:
    return isinstance(parse_or_error(raw), ProtocolError)


@dataclass
class Step:
    to: str  # "fuzzer" or "newcomer"
    raw: str | bytes
    code: str


def malformed(to: str) -> st.SearchStrategy:
    frames = st.one_of(
        st.tuples(mutated(), st.sampled_from(["ascii", "utf8", "bytes"])).map(
            lambda c: encoded(c[0].frame, c[1])
        ),
        shaped_frames().map(json.dumps),
        damaged_text(),
        st.binary(max_size=200),
        st.text(max_size=200),
    )
    # The communicator cannot send an empty frame.
    return frames.filter(lambda raw: raw and rejected(raw)).map(
        lambda raw: Step(to, raw, "bad_message")
    )


def not_allowed_frames(world: World) -> st.SearchStrategy:
    """Well formed, but about jobs, assignments and attempts the fuzzer does not hold."""
    job_keys = st.from_regex(JOB_KEY_PATTERN, fullmatch=True)
    uuids = st.uuids().map(str)

    def cased(ids):
        return st.sampled_from(ids).flatmap(lambda i: st.sampled_from([i, i.upper()]))

    @st.composite
    def frames(draw):
        name = draw(
            st.sampled_from(["JobCompleted", "JobFailed", "AssignJobResponse", "ClusterSignal"])
        )
        body = draw(objects(INBOUND[name]))
        if "job_id" in body:
            job = draw(st.sampled_from(world.job_ids) | job_keys)
            body["job_id"] = draw(st.sampled_from([job, job.replace(job[-36:], job[-36:].upper())]))
        if "assignment_id" in body:
            body["assignment_id"] = draw(cased(world.assignment_ids) | uuids)
        if name == "ClusterSignal":
            body["attempt"] = draw(cased([world.attempt]) | uuids)
            if body.get("to") is not None and draw(st.booleans()):
                body["to"]["role"] = draw(st.sampled_from(["server", "client"]))
        return {"type": name, **body}

    return frames().filter(lambda f: not world.allowed(f)).map(json.dumps)


def refused_steps(world: World) -> st.SearchStrategy:
    not_capabilities = tuple(n for n in sorted(INBOUND) if n != "WorkerCapabilities")
    not_allowed = not_allowed_frames(world).map(lambda raw: Step("fuzzer", raw, "not_allowed"))
    return st.one_of(
        malformed("fuzzer"),
        not_allowed,
        malformed("fuzzer"),
        not_allowed,
        # Before WorkerCapabilities, anything else is bad_message, valid or not.
        malformed("newcomer"),
        valid_frames(not_capabilities).map(
            lambda c: Step("newcomer", json.dumps({"type": c[0], **c[1]}), "bad_message")
        ),
        not_allowed_frames(world).map(lambda raw: Step("newcomer", raw, "bad_message")),
    )


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


@pytest.mark.asyncio
async def test_refused_frames_are_answered_keep_the_session_and_change_nothing(
    worker_session, settings
):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "WORKER_RATE_PER_SEC": 100_000,
        "WORKER_RATE_BURST": 100_000,
    }
    world = await build_world(worker_session)
    on_loop = OnLoop()

    async def refuse_all(steps):
        before = await q(snapshot)
        for step in steps:
            session = getattr(world, step.to)
            await send_raw(session, step.raw)
            reply = await session.recv()
            assert reply["type"] == "Error", reply
            assert reply["code"] == step.code and reply["message"], reply
            assert await q(snapshot) == before
        # Still open and still the same session: a repeated WorkerCapabilities is re-acked
        # and, the offers being scored already, changes nothing either.
        await world.fuzzer.hello()
        assert await q(snapshot) == before

    @SESSION
    @given(st.data())
    def refused(data):
        steps = data.draw(st.lists(refused_steps(world), min_size=1, max_size=8), "steps")
        for step in steps:
            event(f"{step.to}: {step.code}: {type(step.raw).__name__}")
        on_loop(refuse_all(steps))

    await asyncio.to_thread(refused)
    assert await world.fuzzer.silent(0.1) and await world.newcomer.silent(0.1)
    await world.newcomer.hello()  # the newcomer was never ready, and still can be
    await world.fuzzer.close()
    await world.newcomer.close()


@pytest.mark.asyncio
async def test_random_bytes_frames_get_bad_message(worker_session, settings):
    settings.GRADIENT = {
        **settings.GRADIENT,
        "WORKER_RATE_PER_SEC": 100_000,
        "WORKER_RATE_BURST": 100_000,
    }
    _, session = await worker_session()
    assert (await session.connect())[0]
    await session.hello()
    on_loop = OnLoop()

    async def refuse_all(frames):
        before = await q(snapshot)
        for raw in frames:
            await session.ws.send_to(bytes_data=raw)
            reply = await session.recv()
            assert (reply["type"], reply["code"]) == ("Error", "bad_message"), reply
        assert await q(snapshot) == before
        await session.hello()

    @SESSION
    @given(st.lists(st.binary(min_size=1, max_size=512).filter(rejected), min_size=1, max_size=8))
    def refused(frames):
        on_loop(refuse_all(frames))

    await asyncio.to_thread(refused)
    await session.close()


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
        return message.model_dump()
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
