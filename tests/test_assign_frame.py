"""An AssignJob is rendered from a claim's rows without its models (workers.assignment): the
frame must stay the very text the protocol's model renders, whatever the fields hold."""

import uuid

from hypothesis import given
from hypothesis import strategies as st

from gradient.wire.protocol import AssignJob, ClusterHold, JobSpec
from workers.assignment import assign_job

texts = st.text(max_size=12)  # any text: quotes, backslashes, control and non-ASCII characters
holds = st.none() | st.builds(
    dict,
    attempt=st.uuids().map(str),
    role=texts,
    index=st.integers(min_value=0, max_value=2**31),
    hold_secs=st.integers(min_value=0, max_value=10**6),
)
# What a claim reads back of a job's work (gradient.jobs.statements.CLAIMED_WORK); None for none.
works = st.none() | st.builds(
    dict,
    command=st.none() | st.lists(texts.filter(bool), min_size=1, max_size=3),
    env=st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True), texts),
    timeout_secs=st.none() | st.integers(min_value=1, max_value=604800),
)


@given(
    kind=st.sampled_from(["eval", "build"]),
    job=st.uuids(),
    assignment=st.uuids(),
    project=texts,
    architecture=texts,
    features=st.lists(texts, max_size=3),
    steps=st.lists(texts, max_size=3),
    hold=holds,
    work=works,
)
def test_the_rendered_frame_is_the_models_own(
    kind, job: uuid.UUID, assignment, project, architecture, features, steps, hold, work
):
    key = f"{kind}:{job}"
    rendered = assign_job(
        key, assignment, kind, job, project, architecture, features, steps, hold, work
    )
    model = AssignJob(
        job_id=key,
        assignment_id=str(assignment),
        job=JobSpec(
            kind=kind,
            project=project,
            evaluation=str(job) if kind == "eval" else None,
            build=str(job) if kind == "build" else None,
            architecture=architecture,
            required_features=features,
            steps=steps,
            **(work or {}),
        ),
        cluster=None if hold is None else ClusterHold(**hold),
    )
    assert rendered.frame() == model.frame()
    assert rendered.job_id == key
    assert rendered.message == model
