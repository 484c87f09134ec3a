"""The steps an AssignJob asks of a worker (protocol.md, AssignJob.steps), by what the job is."""

from gradient.jobs.models import JobKind

FULL_STEPS = ["fetch", "evaluate_flake", "evaluate_derivations"]
# An evaluation may be split: fetched on one worker, then evaluated from the Fetching state.
FETCH_STEPS = ["fetch"]
FOLLOW_UP_STEPS = ["evaluate_flake", "evaluate_derivations"]
BUILD_STEPS = ["build"]
# A member's evaluation is never split: its cluster starts it whole, on its seat.
MEMBER_STEPS = {JobKind.EVAL: FULL_STEPS, JobKind.BUILD: BUILD_STEPS}
