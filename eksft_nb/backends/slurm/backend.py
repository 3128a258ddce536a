"""SlurmBackend: a job's lifecycle on a Slurm cluster, through its commands (see :mod:`.cluster`).

A job is a folder on a disk every node and this machine share (``--shared-dir``), as a local job's
folder, plus ``slurm.json`` (its Slurm job id). The ranks write their events there and the watcher
inside the allocation (:mod:`.allocation`) records the start, the restarts and the end, so the monitor,
the dashboard and goodput read it as they read a local job. Slurm says where the job stands before
its events do (pending, and why) and after they stop (cancelled, or forgotten).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from ...control import FaultCommand, submit
from ...errors import JobError, UnknownJobError, shown
from ...jobdir import JobDir, atomic_write, eksft_home
from ...spec import JobSpec
from ...spec_checks import valid_name
from ...states import ACTIVE, JobState
from ...tails import bounded, tail_lines
from ..base import Backend, JobSummary, readable
from ..folder import FolderJobs
from . import checks, cluster, engine_parts
from .carried import RECORD
from .notices import WAITING, waiting_detail
from .render import NO_EKSFT, STOP_MARK, job_dir, new_job_uid

SHARED_DIR_ENV = "EKSFT_SHARED_DIR"
BATCH_LOG_BYTES = 64 << 10   # of the batch log's end read for why a job failed


class SlurmBackend(FolderJobs, Backend):
    """The jobs under one shared folder (``shared_dir``, default ``$EKSFT_SHARED_DIR``) and those this
    machine launched (each leaves a link to its folder in ``$EKSFT_HOME/slurm``); a launched job's spec
    names its own folder (``--shared-dir``)."""

    name = "slurm"
    locator_keys = ("shared_dir",)

    def __init__(self, shared_dir: str | Path | None = None) -> None:
        root = shared_dir or os.environ.get(SHARED_DIR_ENV)
        self.root = Path(root) if root else None
        self.links = eksft_home() / "slurm"

    def _jd(self, name: str) -> JobDir:
        if valid_name(name):
            if self.root is not None and (self.root / name / "spec.json").is_file():
                return JobDir(self.root / name)
            link = self.links / name
            if link.is_symlink() and (link / "spec.json").is_file():
                return JobDir(link.resolve())
        raise UnknownJobError(f"no Slurm job named {shown(name)} was launched here"
                              + (f" nor is one under {self.root}" if self.root else ""),
                              f"check the name, or set {SHARED_DIR_ENV} to the --shared-dir it was "
                              "launched with")

    def locator(self, spec: JobSpec) -> dict[str, str]:
        return {"shared_dir": str(spec.slurm.shared_dir)}

    def configured(self) -> bool:
        """A shared folder named, or a job launched from here (an empty links folder names none)."""
        return self.root is not None or any(self.links.glob("*"))

    def _record(self, jd: JobDir) -> dict:
        try:
            record = json.loads((jd.path / RECORD).read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) and str(record.get("job_id", "")).isdigit() else {}

    # ---- launch -------------------------------------------------------------------------------
    def check(self, spec: JobSpec, launching: bool = True) -> JobSpec:
        """No script yet, GPUs and ranks that fit (:mod:`.checks`), and (``launching``) the shared folder
        mounted here. Hot spares are NVRx's standby nodes: the NVRx on the nodes is checked where it runs (the
        watcher's doctor gate, see ``allocation``)."""
        if spec.script:
            raise JobError("--script is not supported on Slurm yet",
                           "run the built-in trainer, or use --backend local")
        checks.check(spec, launching)
        shared = Path(str(spec.slurm.shared_dir))
        if launching and not shared.is_dir():
            raise JobError(f"the shared folder {shared} does not exist here",
                           "mount it on this machine at the path the nodes use, or fix --shared-dir")
        return spec

    def render(self, spec: JobSpec, queue_objects: bool = False) -> str:
        """The sbatch script (``queue_objects``: Slurm has no queue objects to add)."""
        assert spec.backend == self.name
        return engine_parts.of(spec).render(spec)

    def launch(self, spec: JobSpec, faults: list[FaultCommand] | None = None) -> None:
        assert spec.backend == self.name and not spec.script
        jd = job_dir(spec)
        job_uid = new_job_uid()
        script = engine_parts.of(spec).render(spec, job_uid)
        jd.create(spec)   # refuses a job folder that exists
        for f in faults or []:
            submit(jd.pending, f)
        try:
            job_id = cluster.sbatch(script, str(jd.path))
        except JobError:
            atomic_write(jd.path / RECORD, json.dumps({"job_id": "", "error": "sbatch failed"}))
            raise
        atomic_write(jd.path / RECORD, json.dumps({"job_id": job_id, "job_uid": f"{job_uid}-{job_id}",
                                                       "submitted": time.time()}))
        self.links.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.links / spec.name).unlink(missing_ok=True)
        (self.links / spec.name).symlink_to(jd.path)

    # ---- queries -------------------------------------------------------------------------------
    def jobs(self) -> list[JobSummary]:
        found = {p.name: p for p in self.links.glob("*") if p.is_symlink()} if self.links.is_dir() else {}
        if self.root is not None and self.root.is_dir():
            found.update((p.name, p) for p in self.root.glob("*"))
        mine = [p for p in found.values() if (p / RECORD).is_file() and (p / "spec.json").is_file()]
        mine.sort(key=lambda p: p.stat().st_mtime)
        return [self.state(p.name) for p in mine]

    def state(self, name: str) -> JobSummary:
        """Slurm's view: pending (with its reason), running, cancelled; lost once Slurm forgot a job
        whose events never recorded an end."""
        jd = self._jd(name)
        job_id = str(self._record(jd).get("job_id", ""))
        if not job_id:
            return JobSummary(name, self.name, JobState.FAILED, "it was never submitted (sbatch failed)")
        job = cluster.show_job(job_id)
        if job is None:
            return JobSummary(name, self.name, JobState.LOST,
                              f"Slurm no longer knows job {job_id} and its events "
                              f"recorded no end; see {jd.logs}/slurm-{job_id}.out")
        if job.state == JobState.STARTING:
            return JobSummary(name, self.name, JobState.STARTING, _waiting(job))
        if job.state == JobState.STOPPED:
            by = ("stopped by the user" if (jd.path / STOP_MARK).exists()
                  else "cancelled outside eksft (scancel)")
            return JobSummary(name, self.name, JobState.STOPPED,
                              f"{by}: Slurm job {job_id} {job.slurm_state}")
        if job.state == JobState.FAILED:
            return JobSummary(name, self.name, JobState.FAILED, f"Slurm job {job_id} {job.slurm_state}"
                              + (f" ({job.reason})" if job.reason not in ("", "None") else "")
                              + _batch_reason(jd.logs / f"slurm-{job_id}.out"))
        waiting = waiting_detail(jd.path / WAITING, job.restarts) if job.state == JobState.RUNNING else None
        return JobSummary(name, self.name, job.state, waiting or f"Slurm job {job_id} on {job.nodes}")

    def logs(self, name: str, lines: int = 200, debug: bool = False) -> str:
        """The batch script's output, then each node's launcher log (``srun`` writes one per node)."""
        jd = self._jd(name)
        out: list[str] = []
        notes: list[str] = []   # files of which only the end is read (anything in the job can grow them)
        logs = sorted(jd.logs.glob("slurm-*.out")) + sorted(jd.logs.glob("launcher-*.log"),
                                                            key=lambda p: p.stat().st_mtime)
        for log in logs:
            note, text = tail_lines(log)
            notes.extend([note] if note else [])
            tag = f"[{log.stem}] "
            out += [tag + line for line in (text if debug else readable(text))]
        return "\n".join([f"[eksft] {note}" for note in notes] + [bounded("\n".join(out[-lines:]))])

    # ---- control -------------------------------------------------------------------------------
    def stop(self, name: str, timeout: float = 60.0) -> None:
        """``scancel`` the job (marked as the user's stop first); returns once Slurm says it ended."""
        jd = self._jd(name)
        job_id = str(self._record(jd).get("job_id", ""))
        if not job_id:
            return
        atomic_write(jd.path / STOP_MARK, str(time.time()))
        cluster.scancel(job_id)
        deadline = time.time() + timeout
        while ((job := cluster.show_job(job_id)) is not None and job.state in ACTIVE
               and time.time() < deadline):
            time.sleep(0.5)
        if job is not None and job.state in ACTIVE:
            raise JobError(f"Slurm job {job_id} of {name} is still {job.slurm_state} after {timeout:g}s",
                           f"check `scontrol show job {job_id}` (a node may not answer)")

    def remove(self, name: str) -> None:
        """Delete an ended job's folder (checkpoints included) from the shared disk, and its link here."""
        status = self.state(name)
        if status.state in ACTIVE:
            raise JobError(f"job {name!r} is still {status.state} on Slurm",
                           "stop it first: `python -m eksft_nb stop "
                           f"{name} --backend slurm`")
        shutil.rmtree(self._jd(name).path)
        (self.links / name).unlink(missing_ok=True)


def _batch_reason(log: Path) -> str:
    """Why the batch shell ended, from the end of its log (the job's to write: read bounded, shown
    bounded): eksft's own last word there, or python's that it cannot import eksft_nb."""
    try:
        _, lines = tail_lines(log, BATCH_LOG_BYTES)
    except OSError:
        return ""
    where = f" (in {log.parent.name}/{log.name})"
    if any("No module named 'eksft_nb'" in line for line in lines):
        return f": ModuleNotFoundError: No module named 'eksft_nb'{where}: {NO_EKSFT}"
    said = [line.removeprefix("eksft: ") for line in lines if line.startswith("eksft: ")]
    return f": {shown(said[-1], 300)[1:-1]}{where}" if said else ""


def _waiting(job: cluster.SlurmJob) -> str:
    """Why a job has not started, as Slurm says it ("waiting: Resources in partition gpu")."""
    if job.slurm_state == "PENDING":
        reason = job.reason if job.reason not in ("", "None") else "scheduling"
        return f"waiting: {reason} in partition {job.partition}"
    return f"Slurm job {job.job_id} {job.slurm_state.lower()}"
