"""A run's environment (protocol.md, "A run"): the agent's own, the job's `env`, and the
GRADIENT_ variables that tell the process who it is and, for a cluster member, who its peers
are. Pure: the files it names are written by workers.agent.run."""

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

RESERVED_PREFIX = "GRADIENT_"


@dataclass(frozen=True)
class Member:
    """What a cluster member's process is told beyond a single job's variables."""

    attempt: str
    role: str
    index: int
    roster: list[dict]  # StartCluster's roster: [{role, index, worker, zone, endpoint}]
    roster_file: str
    hostfile: str
    signal_socket: str


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment as a job sees it. The GRADIENT_ names are the agent's to set
    (a job's env may not use them), and one of them is the agent's token."""
    return {name: value for name, value in environ.items() if not name.startswith(RESERVED_PREFIX)}


def peer_variable(role: str, index: int) -> str:
    """GRADIENT_PEER_<ROLE>_<INDEX>: the role upper-cased, each character outside A-Z0-9
    written `_`, so any role makes a name a shell can read."""
    return f"GRADIENT_PEER_{re.sub(r'[^A-Z0-9]', '_', role.upper())}_{index}"


def hostfile_text(roster: list[dict]) -> str:
    """One line per member in roster order: its endpoint, or its worker's name where it has
    none (as an MPI hostfile lists hosts)."""
    return "".join(f"{entry['endpoint'] or entry['worker']}\n" for entry in roster)


def roster_text(roster: list[dict]) -> str:
    return json.dumps(roster, separators=(",", ":"))


def job_env(
    environ: Mapping[str, str],
    job: Mapping[str, str],
    *,
    job_id: str,
    assignment_id: str,
    worker: str,
    endpoint: str | None,
    member: Member | None = None,
) -> dict[str, str]:
    """The whole environment of a run: the agent's (less its GRADIENT_ names), the job's env,
    then the GRADIENT_ variables, which nothing overrides."""
    env = inherited(environ) | dict(job)
    env |= {
        "GRADIENT_JOB_ID": job_id,
        "GRADIENT_ASSIGNMENT_ID": assignment_id,
        "GRADIENT_WORKER": worker,
        "GRADIENT_ENDPOINT": endpoint or "",
    }
    if member is None:
        return env
    env |= {
        "GRADIENT_ATTEMPT": member.attempt,
        "GRADIENT_ROLE": member.role,
        "GRADIENT_INDEX": str(member.index),
        "GRADIENT_ROSTER": roster_text(member.roster),
        "GRADIENT_ROSTER_FILE": member.roster_file,
        "GRADIENT_HOSTFILE": member.hostfile,
        "GRADIENT_SIGNAL_SOCKET": member.signal_socket,
    }
    for entry in member.roster:
        env[peer_variable(entry["role"], entry["index"])] = entry["endpoint"] or ""
    return env
