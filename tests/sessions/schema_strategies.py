"""Hypothesis strategies derived from the schemas of gradient.wire.protocol: every field type of
protocol.py maps to a JSON kind and a strategy of valid JSON values, and a frame's typed
places (slots) can be walked, read, set and dropped. An unknown field type fails loudly here
rather than go unfuzzed."""

import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from hypothesis import strategies as st
from pydantic import BaseModel, StringConstraints
from pydantic.fields import FieldInfo

from gradient.wire.protocol import INBOUND

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
    if is_model(t) or get_origin(t) is dict:
        return frozenset({"object"})
    known = {bool: "bool", int: "int", str: "string"}
    if t in known:
        return frozenset({known[t]})
    raise TypeError(f"no JSON kind for {t!r}: teach schema_strategies about it")


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
    if get_origin(t) is dict:
        names, values = get_args(t)
        return st.dictionaries(valid(names), valid(values), max_size=3)
    if t is bool:
        return st.booleans()
    if t is int:
        return st.integers(min_value=b.ge, max_value=b.le)
    if t is str:
        text = st.from_regex(b.pattern, fullmatch=True) if b.pattern else st.text(max_size=16)
        return text.filter(b.admits) if b.max_length is not None else text
    if is_model(t):
        return objects(t)
    raise TypeError(f"no strategy for {t!r}: teach schema_strategies about it")


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


INBOUND_NAMES = tuple(sorted(INBOUND))


@st.composite
def valid_frames(draw, names=INBOUND_NAMES):
    name = draw(st.sampled_from(names))
    return name, draw(objects(INBOUND[name]))
