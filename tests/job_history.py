"""Ended job folders, many at once, written through the project's own JobDir and EventWriter as a supervisor
writes them (the spec, the events of each step and save, a restart, the end in ``end.json``, the job's
``job_end`` event and ``supervisor.json``): the lab panel's browser test lists 300 of them beside its real
jobs, and bench/jobs_panel.py measures a listing of them. No process runs.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eksft_nb.events import EventWriter, make
from eksft_nb.jobdir import JobDir, atomic_write
from eksft_nb.spec import JobSpec
from eksft_nb.states import JobState

# what the failed ones say, as a supervisor ends such a job: the script's own error, and what to do
FAILED_REASON = ("gave up after 3 in-job restarts: rank 1 raised ModuleNotFoundError: No module named "
                 "'mylib' (the script's own error, at every restart): install mylib where the ranks run, "
                 "then resume")


@dataclass(frozen=True)
class Ended:
    name: str
    state: JobState
    reason: str
    ended_at: float


def history(root: Path, count: int, *, steps: int = 20, newest_end: float, every_s: float = 600.0,
            prefix: str = "hist") -> list[Ended]:
    """``count`` ended jobs in ``root`` (a jobs folder), the i-th ending ``every_s`` after the one before,
    the last at ``newest_end``: every 10th failed (with :data:`FAILED_REASON`), every 15th stopped, every
    7th with a restart, the rest succeeded. Written in threads (each folder's creation syncs its spec and
    its end reserve to disk); the jobs as written, oldest end first."""
    jobs = [Ended(f"{prefix}-{i:03d}", *_fate(i), newest_end - (count - 1 - i) * every_s)
            for i in range(count)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: _write(root, j, steps), jobs))
    return jobs


def _fate(i: int) -> tuple[JobState, str]:
    if i % 10 == 3:
        return JobState.FAILED, FAILED_REASON
    if i % 15 == 4:
        return JobState.STOPPED, "stopped by the user"
    return JobState.SUCCEEDED, "all steps done"


def _write(root: Path, job: Ended, steps: int) -> None:
    spec = JobSpec().replace(name=job.name, steps=steps).validate()
    jd = JobDir.for_name(job.name, root)
    jd.create(spec)
    done = steps if job.state == JobState.SUCCEEDED else steps // 2
    t = job.ended_at - done * 0.5 - 5.0
    events = [make("job_start", job.name, None, t=t, spec_digest="x", world_size=2, steps=steps,
                   backend="local", host="h", pid=1)]
    for step in range(1, done + 1):
        t += 0.5
        events.append(make("step", job.name, 0, t=t, step=step, loss=5.0 - step / 100, tokens=1024,
                           step_time=0.5))
        if step % 5 == 0:
            events += [make("checkpoint", job.name, 0, t=t, phase="begin", step=step, mode="async"),
                       make("checkpoint", job.name, 0, t=t + 0.1, phase="committed", step=step,
                            blocked_s=0.02, background_s=0.08, bytes=100,
                            path=str(jd.path / "ckpt" / f"step_{step:08d}"))]
        if step == 7 and int(job.name.rsplit("-", 1)[1]) % 7 == 0:
            cause = "injected sigkill on rank 1"
            events += [make("failure", job.name, None, t=t, level="injob", cause=cause, blame_rank=1,
                            fault_time=t, detected_at=t + 0.5),
                       make("restart", job.name, None, t=t + 3.0, level="injob", cause=cause, blame_rank=1,
                            fault_time=t, detection_s=0.5, downtime_s=3.0, rolled_back_steps=2,
                            resumed_step=5)]
    events.append(make("job_end", job.name, None, t=job.ended_at, state=job.state, reason=job.reason,
                       final_step=done))
    writer = EventWriter(jd.events_path, job.name)
    for e in events:
        writer.write(e)
    writer.close()
    jd.write_end(job.state, job.reason)
    atomic_write(jd.supervisor_path, json.dumps({"state": job.state, "reason": job.reason}))


def done_and_live(home: Path, monkeypatch: Any) -> tuple[Any, Any, list[str]]:
    """In ``home``: "done" (5 steps, ended) and "live" (3 steps, running), and the list that from now on
    gets the name of each job whose events are read (EventTail.read): what a listing folded."""
    from eksft_nb.events import EventTail
    from test_dashboard import FakeJob

    monkeypatch.setenv("EKSFT_HOME", str(home))
    done, live = FakeJob("done", steps=5), FakeJob("live")
    done.steps(1, 5)
    done.end()
    live.steps(1, 3)
    folded: list[str] = []
    read = EventTail.read
    monkeypatch.setattr(EventTail, "read", lambda tail: folded.append(tail.path.parent.name) or read(tail))
    return done, live, folded
