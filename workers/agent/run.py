"""What the agent does to run one assignment (protocol.md, "A run"): a cluster member's files
(the roster, the hostfile) and signal socket, the process's environment, then the process."""

import asyncio
import os
from pathlib import Path

from workers.agent import env
from workers.agent.process import JobProcess
from workers.client import Job

ROSTER_FILE = "roster.json"
HOSTFILE = "hostfile"


def member_files(directory: Path, roster: list[dict]) -> tuple[str, str]:
    """Writes a member's roster and hostfile in `directory` (the agent's, not the job's: the
    job's directory is made fresh when its process starts); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    roster_file, hostfile = directory / ROSTER_FILE, directory / HOSTFILE
    roster_file.write_text(env.roster_text(roster) + "\n")
    hostfile.write_text(env.hostfile_text(roster))
    return str(roster_file), str(hostfile)


async def prepare(agent, job: Job) -> JobProcess:
    """The job's process, not yet started; a member's files and socket are ready for it."""
    spec = job.spec
    member = None
    if job.attempt is not None:
        files = agent.runtime / "members" / job.assignment_id
        # Two small files, written on the loop: a thread's hop costs more than the writes.
        roster_file, hostfile = member_files(files, job.roster)
        socket = await agent.hub.open(job.attempt)
        member = env.Member(
            attempt=job.attempt,
            role=job.role,
            index=job.index,
            roster=job.roster,
            roster_file=roster_file,
            hostfile=hostfile,
            signal_socket=socket,
        )
    process_env = env.job_env(
        os.environ,
        spec.env,
        job_id=job.job_id,
        assignment_id=job.assignment_id,
        worker=agent.name or "",
        endpoint=agent.config.endpoint,
        member=member,
    )
    return JobProcess(
        agent.workdir / job.assignment_id,
        spec.command or [],  # none: the process reports "the job has no command"
        process_env,
        timeout_secs=spec.timeout_secs,
        kill_grace=agent.kill_grace,
    )


async def cleanup(agent, job: Job) -> None:
    """After the run: a member's socket and files go; old job directories are pruned. A
    failure here is logged, never taken for the job's."""
    try:
        if job.attempt is not None:
            await agent.hub.close(job.attempt)
            await asyncio.to_thread(_remove, agent.runtime / "members" / job.assignment_id)
        await asyncio.to_thread(agent.prune)
    except OSError as exc:
        agent._record("cleanup_failed", **job.ids(), error=str(exc))


def _remove(directory: Path) -> None:
    for name in (ROSTER_FILE, HOSTFILE):
        (directory / name).unlink(missing_ok=True)
    if directory.exists():
        directory.rmdir()
