"""submit_cluster --file: the whole cluster as one JSON document (protocol.md, "Submitting").
Its shape is the models below (an unknown field is refused, as a misspelt one would pass for its
default); its rules those of every submission. A refusal names the field, and writes nothing.
"""

import json
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from clusters.models import ClusterJob, ClusterMember
from clusters.submission import MemberSpec, check_role, submit_cluster
from gradient.jobs.management.json_command import text_problem
from gradient.jobs.submission import JobSpec, SubmissionError

DOCUMENT = "document"  # the field named when the document as a whole is wrong


def _storable(value: str) -> str:
    problem = text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


Text = Annotated[StrictStr, AfterValidator(_storable)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MemberDocument(_Strict):
    role: Text
    kind: Text
    primary: StrictBool = False
    pin: Text | None = None
    arch: Text | None = None  # None: the model's default, x86_64-linux
    features: list[Text] = []
    paths: list[Text] = []
    # Any JSON here: what the work may hold is gradient.jobs.work's to say.
    command: Any = None
    env: Any = Field(default_factory=dict)
    timeout_secs: Any = None

    def spec(self) -> MemberSpec:
        check_role(self.role)
        job = JobSpec(
            kind=self.kind,
            architecture=self.arch,
            required_features=tuple(self.features),
            paths=tuple(self.paths),
            command=self.command,
            env=self.env,
            timeout_secs=self.timeout_secs,
        )
        return MemberSpec(role=self.role, job=job, primary=self.primary, pin=self.pin)


class ClusterDocument(_Strict):
    project: Text
    same_zone: StrictBool = False
    retry_budget: StrictInt = 0
    prioritized: StrictBool = False
    members: Annotated[list[MemberDocument], Field(min_length=1)]


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
    # json.loads keeps the last of a repeated key: a slip that would pass silently.
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise SubmissionError("given twice in one object", key)
        seen[key] = value
    return seen


def _field(loc: tuple) -> str:
    """("members", 1, "command") -> "members[1].command"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or DOCUMENT


def _refusal(exc: ValidationError) -> SubmissionError:
    error = exc.errors()[0]
    if error["type"] == "extra_forbidden":
        problem = "unknown field"
    elif error["type"] == "missing":
        problem = "is required"
    elif error["type"] == "value_error":
        problem = str(error["ctx"]["error"])
    else:
        problem = error["msg"]
    return SubmissionError(problem, _field(error["loc"]))


def read_document(data: bytes) -> tuple[ClusterDocument, list[MemberSpec]]:
    """The document and its members as submit_cluster takes them, or a SubmissionError."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise SubmissionError(f"not UTF-8 text (byte {e.start})", DOCUMENT) from None
    try:
        parsed = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except SubmissionError:
        raise
    except ValueError as e:
        raise SubmissionError(f"not JSON ({e})", DOCUMENT) from None
    try:
        document = ClusterDocument.model_validate(parsed)
    except ValidationError as e:
        raise _refusal(e) from None
    members = []
    for i, member in enumerate(document.members):
        try:
            members.append(member.spec())
        except SubmissionError as e:
            raise e.within(f"members[{i}]") from None
    return document, members


def submit_document(data: bytes) -> tuple[ClusterJob, list[ClusterMember]]:
    """Create the cluster a document describes, as submit_cluster does with --member SPECs."""
    document, members = read_document(data)
    return submit_cluster(
        document.project,
        members,
        same_zone=document.same_zone,
        retry_budget=document.retry_budget,
        prioritized=document.prioritized,
    )
