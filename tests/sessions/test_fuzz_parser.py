"""Fuzzing the worker protocol's parser alone (no database, many examples): strategies
derived from the schemas of gradient.wire.protocol, over every message, plus arbitrary JSON, text
and bytes. The parser returns a message of the frame's class or raises ProtocolError with a
message, never anything else; valid frames parse back equal, unknown fields are ignored, a
dropped or mistyped field is refused.
"""

import json

import pytest
from hypothesis import event, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st

from gradient.wire.protocol import INBOUND, OUTBOUND, ProtocolError, parse_inbound, parse_outbound
from tests.sessions.bad_frames import (
    MUTATIONS,
    damaged_text,
    encoded,
    mutated,
    parse_or_error,
    shaped_frames,
)
from tests.sessions.schema_strategies import (
    JSON_KINDS,
    OF_KIND,
    dumped,
    json_values,
    kinds,
    objects,
    valid_frames,
)

PARSER = fuzz_settings(max_examples=250, deadline=None)


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
