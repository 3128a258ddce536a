"""The local backend: real ranks on this machine (CPU/gloo, or NCCL on GPUs), one folder per job.

A job runs under a detached supervisor (its own session), so it survives the kernel or shell that
launched it; any process can attach to it by name through its folder. A supervisor that dies is
replaced by one that adopts the running job (see :mod:`.supervisor`); the job's processes are found
by identity (see :mod:`eksft_nb.procs`), so no query or stop ever signals a process that merely reuses a pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from ... import nvrx
from ...checkpoint_folders import STEP_DIR, list_checkpoints, verify
from ...control import FaultCommand, submit
from ...errors import EksftError, JobError
from ...events import read_all
from ...jobdir import JobDir, jobs_root
from ...monitor import JobMonitor
from ...runtime.memcopy import remove_copies, remove_stale_copies
from ...runtime.quiet import quiet_env
from ...spec import JobSpec
from ...states import ACTIVE, CheckpointState, JobState
from ...tails import bounded, tail_lines
from ...timeouts import derive, resolved
from ... import procs
from ..base import Backend, JobSummary, readable
from ..folder import FolderJobs
from . import ending, engine_parts

class LocalBackend(FolderJobs, Backend):
    name = "local"

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root else jobs_root()

    def _jd(self, name: str) -> JobDir:
        return JobDir.existing(name, self.root)

    # ---- launch -------------------------------------------------------------------------------
    def check(self, spec: JobSpec, launching: bool = True) -> JobSpec:
        """NVRx must take spares; a script and its working directory must exist here (their paths are
        fixed now: ranks start in the job folder)."""
        if not launching:
            return spec
        found = nvrx.require()  # the supervisor, launchers and ranks import the NVRx this process finds
        if (refused := found.cannot_run(spec)) is not None:
            raise refused
        if not spec.script:
            return spec
        if not Path(spec.script).is_file():
            raise JobError(f"training script {spec.script} does not exist", "check the --script path")
        workdir = Path(spec.workdir or os.getcwd()).expanduser().resolve()
        if not workdir.is_dir():
            raise JobError(f"working directory {workdir} does not exist", "check the --workdir path")
        return spec.replace(script=str(Path(spec.script).resolve()), workdir=str(workdir))

    def render(self, spec: JobSpec, queue_objects: bool = False) -> str:
        assert spec.backend == self.name
        lines = [f"# {line}" for line in derive(spec).lines()]
        spec = resolved(spec)
        jd = JobDir.for_name(spec.name, self.root)
        return "\n".join([*lines, engine_parts.of(spec).plan(spec, str(jd.path))])

    def launch(self, spec: JobSpec, faults: list[FaultCommand] | None = None) -> None:
        assert spec.backend == self.name and (not spec.script or Path(spec.script).is_absolute())  # check()ed
        jd = JobDir.for_name(spec.name, self.root)
        if jd.path.exists():
            raise JobError(f"a job named {spec.name!r} already exists in {self.root}",
                           f"choose another --name, or remove it with `python -m eksft_nb rm {spec.name}`")
        _check_resume_source(spec, jd)
        jd.create(resolved(spec))   # the timeouts its launchers and ranks use, filled in (see timeouts.py)
        for f in faults or []:
            submit(jd.pending, f)
        remove_stale_copies(procs.live_marks())  # in-memory checkpoint copies that ended jobs left
        self._start_supervisor(jd, uuid.uuid4().hex[:16])

    def _start_supervisor(self, jd: JobDir, job_uid: str) -> None:
        """Start the job's keeper and supervisor (detached), every process of the job marked ``job_uid``."""
        before = jd.supervisor().get("supervisor")
        with open(jd.logs / "supervisor.err", "ab") as err:
            env = quiet_env({**os.environ, procs.JOB_UID_ENV: job_uid})
            proc = subprocess.Popen([sys.executable, "-m", "eksft_nb.backends.local.keeper", str(jd.path)],
                                    stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                                    start_new_session=True, close_fds=True)
        proc.wait(timeout=30)  # the intermediate process exits once the daemon has forked
        deadline = time.time() + 30
        while jd.supervisor().get("supervisor") in (None, before) and time.time() < deadline:
            time.sleep(0.05)
        if jd.supervisor().get("supervisor") in (None, before):
            raise JobError(f"the supervisor of {jd.name} did not start", f"see {jd.logs / 'supervisor.err'}")

    # ---- queries -------------------------------------------------------------------------------
    def jobs(self) -> list[JobSummary]:
        found = [p for p in self.root.glob("*") if (p / "spec.json").is_file()] if self.root.is_dir() else []
        found.sort(key=lambda p: p.stat().st_mtime)
        return [self.state(p.name) for p in found]

    def state(self, name: str) -> JobSummary:
        """From ``supervisor.json`` and the processes it names; a query, it starts nothing. A job whose
        processes run while neither its supervisor nor its keeper does is ``orphaned``: see :meth:`adopt`."""
        jd = self._jd(name)
        sup = jd.supervisor()
        state = str(sup.get("state", JobState.STARTING))
        uid = _job_uid(sup)
        if state not in ACTIVE or uid is None:
            return JobSummary(name, self.name, state, str(sup.get("reason", "")))
        # a stopped head (SIGSTOP) does nothing: with no other head running, the job is orphaned
        if any(p is not None and not procs.halted(p) for p in _heads(sup, uid)):
            return JobSummary(name, self.name, state, "")
        if not procs.marked(uid):
            return JobSummary(name, self.name, JobState.LOST,
                              "the supervisor is gone (the machine restarted, or it "
                              f"was killed) and nothing of the job runs; see {jd.logs / 'supervisor.err'}")
        return JobSummary(name, self.name, JobState.RUNNING,
                          "its supervisor is gone: nothing supervises the running "
                          "job", orphaned=True)

    def adopt(self, name: str) -> str:
        """Start a new supervisor (and keeper) for an orphaned job, so that it is never left ``lost``."""
        jd = self._jd(name)
        uid = _job_uid(jd.supervisor())
        if uid is None:
            return ""
        _kill_halted(_heads(jd.supervisor(), uid))   # their successors take over (a keeper holds the lock)
        try:
            self._start_supervisor(jd, uid)
        except JobError:
            pass  # another client adopted it first, or a stop holds the lock
        return "its supervisor was gone: a new one adopted the running job"

    def settled(self, name: str) -> bool:
        """The supervisor and its keeper, the last of a job's processes to exit, are gone."""
        sup = self._jd(name).supervisor()
        uid = _job_uid(sup)
        return uid is None or not any(procs.recorded(sup.get(head), uid) for head in ("supervisor", "keeper"))

    def logs(self, name: str, lines: int = 200, debug: bool = False) -> str:
        jd = self._jd(name)
        out: list[str] = []
        notes: list[str] = []   # files of which only the end is read (the notes lead the answer)

        def tail(path: Path) -> list[str]:
            note, text = tail_lines(path)
            notes.extend([note] if note else [])
            return text

        narrative = jd.logs / "supervisor.log"
        if narrative.exists():
            out += [f"[eksft] {line}" for line in tail(narrative)]
        for log in sorted(jd.logs.glob("launcher-*.log"), key=lambda p: p.stat().st_mtime):
            text = tail(log)
            out += text if debug else readable(text)
        if debug and (jd.logs / "supervisor.err").exists():
            out += tail(jd.logs / "supervisor.err")
        return "\n".join([f"[eksft] {note}" for note in notes] + [bounded("\n".join(out[-lines:]))])

    # ---- control -------------------------------------------------------------------------------
    def stop(self, name: str, timeout: float = 60.0) -> None:
        """Ask the supervisor (and its keeper) to end the job, then end whatever still carries the
        job's mark. Only processes whose recorded identity or mark matches are signalled; a head that
        is stopped (SIGSTOP) cannot end anything, so it is killed at once instead of waited on."""
        jd = self._jd(name)
        sup = jd.supervisor()
        uid = _job_uid(sup)
        heads = [p for p in _heads(sup, uid) if p is not None]
        for p in heads:
            try:
                p.terminate()
            except psutil.Error:
                pass
        deadline = time.time() + timeout
        while (left := [p for p in heads if procs.running(p)]) and time.time() < deadline:
            _kill_halted(left)
            time.sleep(0.1)
        lock = jd.keeper_lock()  # no keeper may start (to adopt the job) while it is being ended
        try:
            left = []
            if uid:
                procs.kill_marked(uid)
                left = procs.wait_gone(heads + procs.marked(uid), 10)
                remove_copies(uid)  # the ranks' in-memory checkpoint copies
            if left:
                raise JobError(f"processes {[p.pid for p in left]} of job {name!r} did not exit",
                               "kill them with `kill -9`")
            if jd.supervisor().get("state") in ACTIVE:  # the supervisor could not record it
                mon = JobMonitor()
                mon.update(read_all(jd.events_path))
                ending.record(jd, JobState.STOPPED, "stopped by the user", final_step=mon.last_step)
            ending.tidy(jd)
        finally:
            if lock is not None:
                os.close(lock)

    def remove(self, name: str) -> None:
        error = self._delete(*self._removable(name, *self._others()))
        if error is not None:
            raise error

    def remove_many(self, names: Sequence[str]) -> list[EksftError | None]:
        """:meth:`remove` of each: what it checks across jobs (the marks of the live processes, the resume
        sources of the running jobs) looked up again once a second rather than once per job (each look is
        O(jobs)), a job launched meanwhile being seen within the second; then the folders that may go are
        deleted 8 at a time (a folder's deletion waits on the disk, not the CPU). A few hundred jobs go in
        seconds, not minutes."""
        out: list[EksftError | None] = [None] * len(names)
        doomed: list[tuple[int, tuple[Path, str | None]]] = []
        others, at = None, 0.0
        for i, name in enumerate(names):
            if others is None or time.monotonic() - at > 1.0:
                others, at = self._others(), time.monotonic()
            try:
                doomed.append((i, self._removable(name, *others)))
            except EksftError as e:
                out[i] = e
        with ThreadPoolExecutor(8, thread_name_prefix="eksft-rm") as pool:
            for (i, _), error in zip(doomed, pool.map(lambda d: self._delete(*d[1]), doomed)):
                out[i] = error
        return out

    def _others(self) -> tuple[set[str], list[tuple[str, str, Path]]]:
        """What a removal checks beyond the job itself: the marks of every live process, and each
        running job that resumes from a folder (name, state, that folder)."""
        resuming = []
        for other in self.jobs():
            if other.state not in ACTIVE:
                continue
            try:
                resume = JobDir.existing(other.name, self.root).spec().resume
            except (OSError, ValueError, EksftError):
                continue
            source = Path(resume).expanduser()   # latest, none, step:N name no folder
            if source.is_absolute():
                resuming.append((other.name, str(other.state), source.resolve()))
        return procs.live_marks(), resuming

    def _removable(self, name: str, marks: set[str], resuming: list[tuple[str, str, Path]]
                   ) -> tuple[Path, str | None]:
        """The folder and job uid of an ended job that may be removed, or why it may not (see :meth:`_others`
        for ``marks`` and ``resuming``)."""
        status = self.state(name)
        if status.state in ACTIVE:
            raise JobError(f"job {name!r} is still running",
                           f"stop it first: `python -m eksft_nb stop {name}`")
        uid = _job_uid(self._jd(name).supervisor())
        running = procs.marked(uid) if uid in marks else []
        if running:
            raise JobError(f"processes {[p.pid for p in running]} of job {name!r} still run",
                           f"stop it first: `python -m eksft_nb stop {name}`")
        self._refuse_if_resumed_from(name, resuming)
        return self._jd(name).path, uid

    @staticmethod
    def _delete(folder: Path, uid: str | None) -> JobError | None:
        """Delete a job's folder and its ranks' in-memory copies; why not, where the disk refused."""
        remove_copies(uid)
        try:
            shutil.rmtree(folder)
        except OSError as e:
            return JobError(f"cannot remove {folder} ({e.strerror or e})",
                            "check that the folder is yours and writable, then remove it again")
        return None

    def _refuse_if_resumed_from(self, name: str, resuming: list[tuple[str, str, Path]]) -> None:
        """A running job that resumes from this job's folder (``resume``, ``--resume``) loads from it
        again at every restart until it ends: the folder must outlive it."""
        folder = self._jd(name).path.resolve()
        for other, state, source in resuming:
            if other != name and (source == folder or folder in source.parents):
                raise JobError(f"job {other!r} ({state}) resumes from {source}, in job {name!r}'s "
                               "folder: its restarts load from there",
                               f"wait until it has ended, or stop it: `python -m eksft_nb stop {other}`")


def _heads(record: dict, uid: str | None) -> list[psutil.Process | None]:
    """The job's supervisor and keeper, where each still runs (named by identity and the job's mark)."""
    return [procs.recorded(record.get(head), uid) if uid else None for head in ("supervisor", "keeper")]


def _kill_halted(heads: list[psutil.Process | None]) -> None:
    """SIGKILL those of ``heads`` that are stopped (SIGSTOP): waiting for them would be waiting for good."""
    stopped = [p for p in heads if p is not None and procs.halted(p)]
    for p in stopped:
        try:
            p.kill()   # psutil checks that the pid still names the process it found
        except psutil.Error:
            pass
    psutil.wait_procs(stopped, timeout=5)


def _job_uid(record: dict) -> str | None:
    uid = record.get("job_uid")
    return uid if isinstance(uid, str) and uid else None


def _check_resume_source(spec: JobSpec, jd: JobDir) -> None:
    """A resume that names a step or a folder must point at a committed checkpoint that verifies."""
    if spec.resume in ("latest", "none"):
        return
    if spec.resume.startswith("step:"):
        root = jd.ckpt_dir(spec)
        infos = [i for i in list_checkpoints(root) if i.step == spec.resume_step]
        committed = [i for i in list_checkpoints(root) if i.state == CheckpointState.COMMITTED]
        avail = ", ".join(str(i.step) for i in committed) or "none"
        where = f"in {root}"
    elif not STEP_DIR.match(Path(spec.resume).name):  # a job's checkpoint folder: the ranks fall back in it
        root = Path(spec.resume).expanduser()
        if not any(i.state == CheckpointState.COMMITTED for i in list_checkpoints(root)):
            raise JobError(f"no committed checkpoint in {root}",
                           "pick one listed by `python -m eksft_nb ckpts NAME`")
        return
    else:
        path = Path(spec.resume).expanduser()
        infos = [i for i in list_checkpoints(path.parent) if i.path == path]
        committed = [i for i in list_checkpoints(path.parent) if i.state == CheckpointState.COMMITTED]
        avail = ", ".join(str(i.path) for i in committed) or "none"
        where = f"at {path}"
    if not infos:
        raise JobError(f"no checkpoint {where} (committed: {avail})",
                       "pick one listed by `python -m eksft_nb ckpts NAME`")
    reason = verify(infos[0])
    if reason:
        raise JobError(f"checkpoint {infos[0].path} cannot be used: {reason}",
                       "pick an older committed checkpoint")
