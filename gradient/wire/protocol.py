"""Worker protocol v1 (shared protocol.md): one schema per message, validated in one place.
Imports nothing of the project's apps, so the reference worker and tests use it as a client.
Unknown fields are ignored; a missing or mistyped field is a ProtocolError naming it."""

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from gradient.wire.keys import JOB_KEY_PATTERN, UUID_PATTERN

MAX_FRAME_BYTES = 1024 * 1024
MAX_SIGNAL_PAYLOAD_BYTES = 64 * 1024
# The end of a job's output that a report carries and the server keeps (protocol.md).
MAX_LOG_TAIL_BYTES = 64 * 1024
PROTOCOL_VERSION = 1
HEARTBEAT_SECS = 10

JobKindName = Literal["eval", "build"]
FailureKind = Literal[
    "transient",
    "permanent",
    "timeout",
    "substitute_unavailable",
    "inputs_unavailable",
    "corrupt_eval_cache",
    "aborted",
    "canceled",
]
NonNegative = Annotated[StrictInt, Field(ge=0)]
# What the server stores must fit its column (an out-of-range value, or a NUL that PostgreSQL
# text cannot hold, would crash the session): beyond that it is a mistyped field.
SlotCount = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]  # integer
Size = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]  # bigint
NO_NUL = r"^[^\x00]*$"
Label = Annotated[StrictStr, StringConstraints(max_length=64, pattern=NO_NUL)]
Zone = Annotated[StrictStr, StringConstraints(max_length=200, pattern=NO_NUL)]
Endpoint = Annotated[StrictStr, StringConstraints(max_length=500, pattern=NO_NUL)]
# eval:<evaluation uuid> or build:<shared build uuid>
JobKey = Annotated[StrictStr, StringConstraints(pattern=JOB_KEY_PATTERN)]
Uuid = Annotated[StrictStr, StringConstraints(pattern=rf"^{UUID_PATTERN}$")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def frame(self) -> str:
        # pydantic's own encoder, far faster than json.dumps; the type goes first in a frame.
        body = self.model_dump_json()
        head = '{"type":' + json.dumps(type(self).__name__)
        return head + "}" if body == "{}" else head + "," + body[1:]


class Rendered:
    """A message made as its frame's text, for the hot paths that would otherwise build
    thousands of models only to render them. `message` parses it back (tests read it so)."""

    model: type[Message]

    def __init__(self, text: str):
        self.text = text

    def frame(self) -> str:
        return self.text

    @cached_property
    def message(self) -> Message:
        return self.model.model_validate_json(self.text)


# Worker -> server


class RunningJob(Message):
    job_id: JobKey
    assignment_id: Uuid


class WorkerCapabilities(Message):
    architectures: list[Label]
    system_features: list[Label]
    max_concurrent_builds: SlotCount
    max_concurrent_evals: SlotCount
    eval: StrictBool
    build: StrictBool
    fetch: StrictBool
    zone: Zone | None = None
    endpoint: Endpoint | None = None
    # What the worker still runs from an earlier session: those assignments stay open.
    running: Annotated[list[RunningJob], Field(max_length=10_000)] = []


class RequestJob(Message):
    kind: JobKindName


class Score(Message):
    job_id: JobKey
    missing_count: Size
    missing_nar_size: Size


class JobScores(Message):
    scores: list[Score]


class AssignJobResponse(Message):
    job_id: JobKey
    accepted: StrictBool
    reason: StrictStr | None = None


# A job's output may hold any byte; PostgreSQL text holds no NUL, so a report's NULs are a
# mistyped field, as in every other string the server stores.
LogTail = Annotated[StrictStr, StringConstraints(pattern=NO_NUL)]


class JobCompleted(Message):
    job_id: JobKey
    assignment_id: Uuid
    elapsed_ms: NonNegative
    log_tail: LogTail | None = None


class JobFailed(Message):
    job_id: JobKey
    assignment_id: Uuid
    error: StrictStr
    kind: FailureKind
    log_tail: LogTail | None = None


class MemberRef(Message):
    role: StrictStr
    index: NonNegative


class ClusterSignal(Message):
    attempt: Uuid
    to: MemberRef | None = None
    payload: Any

    @field_validator("payload")
    @classmethod
    def payload_fits(cls, value):
        if len(json.dumps(value)) > MAX_SIGNAL_PAYLOAD_BYTES:
            raise ValueError(f"payload over {MAX_SIGNAL_PAYLOAD_BYTES} bytes")
        return value


class Draining(Message):
    pass


INBOUND: dict[str, type[Message]] = {
    m.__name__: m
    for m in (
        WorkerCapabilities,
        RequestJob,
        JobScores,
        AssignJobResponse,
        JobCompleted,
        JobFailed,
        ClusterSignal,
        Draining,
    )
}

# Server -> worker


class InitAck(Message):
    worker: str
    protocol: int = PROTOCOL_VERSION
    heartbeat_secs: int = HEARTBEAT_SECS


class OfferedJob(Message):
    job_id: str
    kind: JobKindName
    project: str
    architecture: str
    required_features: list[str]
    paths: list[str]


class JobOffer(Message):
    jobs: list[OfferedJob]


class JobSpec(Message):
    kind: JobKindName
    project: str
    evaluation: str | None
    build: str | None
    architecture: str
    required_features: list[str]
    steps: list[str]
    # What to run (protocol.md, "Running real work"): argv, extra environment, a time limit.
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout_secs: int | None = None


class ClusterHold(Message):
    attempt: str
    role: str
    index: int
    hold_secs: int


class AssignJob(Message):
    job_id: str
    assignment_id: str
    job: JobSpec
    cluster: ClusterHold | None = None


class RosterEntry(Message):
    role: str
    index: int
    worker: str
    zone: str | None
    endpoint: str | None


class StartCluster(Message):
    attempt: str
    roster: list[RosterEntry]


class AbortCluster(Message):
    attempt: str
    reason: str


class AbortJob(Message):
    job_id: str
    reason: str


class ForwardedSignal(Message):
    """Sent as type ClusterSignal: the worker-bound form names the sender."""

    attempt: str
    from_: MemberRef = Field(serialization_alias="from", validation_alias="from")
    payload: Any

    def frame(self) -> str:
        body = self.model_dump(mode="json", by_alias=True)
        return json.dumps({"type": "ClusterSignal", **body})


class Error(Message):
    code: Literal["bad_message", "not_allowed", "rate_limited"]
    message: str


OUTBOUND: dict[str, type[Message]] = {
    m.__name__: m
    for m in (InitAck, JobOffer, AssignJob, StartCluster, AbortCluster, AbortJob, Error)
} | {"ClusterSignal": ForwardedSignal}


class ProtocolError(ValueError):
    """A frame that is not JSON, has no known type, or has a missing or mistyped field."""


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "frame"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


_object = TypeAdapter(dict[str, Any])


def _parse(text: str | bytes, table: dict[str, type[Message]]) -> Message:
    try:
        data = _object.validate_json(text)
    except ValidationError:
        raise ProtocolError("frame is not a JSON object") from None
    name = data.get("type")
    if not isinstance(name, str) or name not in table:
        raise ProtocolError(f"unknown message type {name!r}")
    try:
        return table[name].model_validate({k: v for k, v in data.items() if k != "type"})
    except ValidationError as exc:
        raise ProtocolError(f"{name}: {_describe(exc)}") from None


def parse_inbound(text: str | bytes) -> Message:
    """A worker's frame -> its message; ProtocolError says what was wrong."""
    return _parse(text, INBOUND)


def parse_outbound(text: str | bytes) -> Message:
    """A server frame -> its message (for workers and tests)."""
    return _parse(text, OUTBOUND)
