"""Frames the parser must refuse or read as the schema says: a valid frame with one
mutation, a known type with arbitrary field values, a frame's text cut short or changed; and
the property every input must keep (parse_or_error)."""

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from hypothesis import strategies as st

from gradient.wire.protocol import INBOUND, OUTBOUND, Message, ProtocolError, parse_inbound
from tests.sessions.schema_strategies import (
    INBOUND_NAMES,
    JSON_KINDS,
    OF_KIND,
    drop_at,
    dumped,
    get_at,
    json_values,
    key,
    kinds,
    objects_at,
    set_at,
    slots,
    valid_frames,
)


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


MUTATIONS = ("drop", "wrong_type", "null", "negative", "huge", "text", "type", "swap_type")


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
    # A WebSocket text frame is UTF-8: it can carry no lone surrogate.
    return text[:at] + draw(st.characters(exclude_categories=("Cs",))) + text[at + 1 :]


def rejected(raw) -> bool:
    return isinstance(parse_or_error(raw), ProtocolError)
