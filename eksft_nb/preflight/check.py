"""``check``: a pre-flight of a job's fault-tolerance settings, before anything runs.

One table of every timeout that acts on the job (NVRx's heartbeats and sections, the in-process
Wrapper's, the process groups', the rendezvous's, the SIGTERM grace and what the scheduler adds to it)
beside the times they must cover (a save and a restore at the storage throughput, a measured step),
and one line for each contradiction between them. A contradiction that guarantees failure (a restore
longer than start-up is allowed: every restart killed) is a refusal, which ``run`` says in one line
with the fix; the others are warnings, said and launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from ..engines.registry import engine_of
from ..launcher import term_timeout
from ..nvrx import NVRx, installed
from ..spec import JobSpec
from ..timeouts import (PROCESS_GROUP_S, Timeout, Timeouts, counted_where_it_runs, derive, on_gpu,
                        wrapper_barrier)
from . import facts
from .sections import missing, read_ft_config, script_sections


class RowDict(TypedDict):
    name: str
    seconds: float | None  # None: unbounded, or not known here
    source: str  # why it has that value, or where it was read
    acts: str  # what happens when it runs out (for a duration: what it is)


class FindingDict(TypedDict):
    refuse: bool  # guarantees failure: run refuses the spec
    problem: str
    fix: str


class CheckResult(TypedDict):
    job: str
    backend: str
    gpu: bool
    rows: list[RowDict]
    findings: list[FindingDict]
    message: str  # the table and the findings, as the CLI prints them


@dataclass(frozen=True)
class Finding:
    refuse: bool
    problem: str
    fix: str

    def line(self) -> str:
        return f"{'refused' if self.refuse else 'warning'}: {self.problem} → {self.fix}"


@dataclass(frozen=True)
class Report:
    spec: JobSpec
    gpu: bool
    rows: list[RowDict]
    findings: list[Finding]

    @property
    def refusals(self) -> list[Finding]:
        return [f for f in self.findings if f.refuse]

    @property
    def warnings(self) -> list[str]:
        return [f"{f.problem} → {f.fix}" for f in self.findings if not f.refuse]

    def text(self) -> str:
        where = "GPUs" if self.gpu else "CPU"
        head = f"timeouts acting on {self.spec.name} ({self.spec.backend} backend, {where}):"
        width = max((len(r["name"]) for r in self.rows), default=10) + 2
        lines = [head]
        for r in self.rows:
            value = "-" if r["seconds"] is None else f"{r['seconds']:g} s"
            lines.append(f"  {r['name']:<{width}}{value:>9}  {r['acts']}  [{r['source']}]")
        lines += [f.line() for f in self.findings] or ["no contradictions found"]
        return "\n".join(lines)

    def to_dict(self) -> CheckResult:
        return {
            "job": self.spec.name,
            "backend": self.spec.backend,
            "gpu": self.gpu,
            "rows": self.rows,
            "findings": [{"refuse": f.refuse, "problem": f.problem, "fix": f.fix} for f in self.findings],
            "message": self.text(),
        }


def check(
    spec: JobSpec, *, release: NVRx | None = None, slurm_config: Any = "read", step_time: float | None = None
) -> Report:
    """The pre-flight of ``spec`` (validated). ``release``: the NVRx the ranks run, where known (default:
    this environment's for a local job; a cluster's image or nodes may run another, which ``doctor``
    checks where they run). ``slurm_config``: ``scontrol show config`` as a dict (None: not reachable;
    default: read it for a Slurm job). ``step_time``: a measured step, where the spec has none."""
    if step_time and not spec.ft.step_time:
        spec = spec.replace(**{"ft.step_time": float(step_time)})
    # a Slurm job without --gres takes the GPU values on GPU nodes: those are checked here (doctor's gate
    # checks the values the node takes, where it runs)
    gpu = on_gpu(spec) or (counted_where_it_runs(spec) and spec.device != "cpu")
    t = derive(spec, gpu)
    if release is None and spec.backend == "local":
        release = installed()
    rows: list[RowDict] = []
    found: list[Finding] = []
    _durations(spec, t, rows)
    if engine_of(spec).node_process == "ft_launcher":
        _launcher_rows(spec, t, rows)
        _timing_findings(spec, t, found)
        _section_findings(spec, t, release, found)
    _scheduler(spec, t, rows, found, slurm_config)
    if not spec.ft.max_injob_restarts and not spec.ft.max_job_restarts:
        found.append(
            Finding(
                False,
                "no restarts are allowed (--max-injob-restarts 0, --max-job-restarts 0): "
                "any failure ends the job",
                "allow some, e.g. --max-injob-restarts 3",
            )
        )
    found.sort(key=lambda f: not f.refuse)
    return Report(spec, gpu, rows, found)


def _row(rows: list[RowDict], name: str, value: Timeout | float | None, acts: str, source: str = "") -> None:
    if isinstance(value, Timeout):
        value, source = value.seconds, source or value.reason
    rows.append(
        {
            "name": name,
            "seconds": None if value is None else _seconds(float(value)),
            "source": source,
            "acts": acts,
        }
    )


def _durations(spec: JobSpec, t: Timeouts, rows: list[RowDict]) -> None:
    """What the timeouts must cover: a save and a restore of the built-in trainer's state, a measured step."""
    mbps = spec.checkpoint.storage_mbps
    if not spec.script:
        at = f"{t.state_bytes / 1e9:.3g} GB at {mbps:g} MB/s"
        _row(rows, "a save", t.save_s, "duration: one checkpoint written", at)
        _row(rows, "a restore", t.restore_s, "duration: every file hashed, then loaded", at)
    if spec.ft.save_time:
        _row(rows, "a save (measured)", spec.ft.save_time, "duration", "--save-time")
    if spec.ft.step_time:
        _row(rows, "a step (measured)", spec.ft.step_time, "duration", "--step-time")


def _launcher_rows(spec: JobSpec, t: Timeouts, rows: list[RowDict]) -> None:
    _row(rows, "initial heartbeat", t.initial, "ft_launcher restarts the group: no first heartbeat")
    _row(rows, "heartbeat", t.heartbeat, "ft_launcher restarts the group: no heartbeat since")
    for name, seconds in t.sections().items():
        own = getattr(t, name, None) if name in ("setup", "step", "checkpointing") else None
        _row(
            rows,
            f"section {name}",
            own if isinstance(own, Timeout) else seconds,
            "ft_launcher restarts the group: a rank stays in it",
            "" if isinstance(own, Timeout) else "set by the user",
        )
    if t.out_of_section is not None:
        _row(rows, "out of section", t.out_of_section, "ft_launcher restarts the group: no section open")
    if spec.ft.cfg_path:
        cfg = read_ft_config(spec.ft.cfg_path)
        for name, seconds in cfg.sections.items():
            if name not in t.sections():
                _row(
                    rows,
                    f"section {name}",
                    seconds,
                    "ft_launcher restarts the group: a rank stays in it",
                    f"--ft-cfg-path {spec.ft.cfg_path}",
                )
    if spec.ft.inprocess and not spec.script:
        _row(rows, "in-process soft", t.soft, "the Wrapper interrupts a rank without progress")
        _row(rows, "in-process hard", t.hard, "the Wrapper kills it")
        _row(
            rows,
            "in-process barrier",
            wrapper_barrier(t.hard.seconds),
            "the ranks wait for each other to restart in place",
            "the hard timeout + 60 s, at least 120",
        )
        _row(rows, "process group", t.collective, "a peer's wait for a rank that failed")
    elif not spec.script:
        _row(
            rows,
            "process group",
            PROCESS_GROUP_S,
            "a collective's wait (NCCL's watchdog, gloo)",
            "the trainer's, without in-process restart",
        )
    if not spec.script:
        _row(rows, "checkpoint group", t.checkpoint_group, "a checkpoint collective's wait for its peers")
    _row(
        rows,
        "rendezvous join",
        facts.RDZV_JOIN_S,
        "a launcher waits for the others to join",
        "torch's c10d default, as ft_launcher runs it",
    )
    _row(
        rows,
        "launcher term",
        term_timeout(spec, t.gpu),
        "ft_launcher's SIGTERM to SIGKILL of its ranks",
        "the grace period" if t.gpu or spec.backend == "eks" else "CPU",
    )


def _timing_findings(spec: JobSpec, t: Timeouts, found: list[Finding]) -> None:
    """Timeouts shorter than what they must let through."""
    mbps, ft = spec.checkpoint.storage_mbps, spec.ft
    save = max(t.save_s, ft.save_time or 0.0)
    if not spec.script:
        # the keepalive beats through a restore for up to the initial timeout's length, then beats stop
        bound, what, flag = (
            (t.setup.seconds, f"the setup section allows {t.setup.seconds:g} s", "--setup-timeout")
            if t.setup is not None
            else (
                t.initial.seconds + t.heartbeat.seconds,
                f"the initial heartbeat and heartbeat timeouts allow {t.initial.seconds:g} + "
                f"{t.heartbeat.seconds:g} s",
                "--initial-heartbeat-timeout",
            )
        )
        _over(
            found,
            t.restore_s,
            bound,
            f"a restore takes ~{t.restore_s:.0f} s at {mbps:g} MB/s but {what}",
            "every restart would be killed",
            f"raise {flag} above {1.25 * t.restore_s:.0f}, or set "
            "--storage-mbps to what the storage delivers",
        )
        if t.checkpointing is not None:
            _over(
                found,
                save,
                t.checkpointing.seconds,
                f"a save takes ~{save:.0f} s but the checkpointing "
                f"section allows {t.checkpointing.seconds:g} s",
                "every save would be killed (the last one and a drain's block on theirs)",
                f"raise --checkpoint-timeout above {1.25 * save:.0f}",
            )
        elif spec.checkpoint.mode == "sync":
            _over(
                found,
                save,
                t.heartbeat.seconds,
                f"a sync save takes ~{save:.0f} s without a heartbeat but "
                f"the heartbeat timeout is {t.heartbeat.seconds:g} s",
                "every save would be killed",
                f"raise --heartbeat-timeout above {1.25 * save:.0f}, or use --ckpt-mode async",
            )
        if spec.ft.inprocess and spec.checkpoint.mode == "sync":
            _over(
                found,
                save,
                t.soft.seconds,
                f"a sync save takes ~{save:.0f} s but the in-process soft timeout is {t.soft.seconds:g} s",
                "every save would be interrupted as a hang",
                f"raise --soft-timeout above {1.25 * save:.0f}, or use --ckpt-mode async",
            )
    step = ft.step_time
    if step:
        bounds = [(t.heartbeat.seconds, "the heartbeat timeout", "--heartbeat-timeout")]
        if t.step is not None:
            bounds.append((t.step.seconds, "the step section", "--step-timeout"))
        if spec.ft.inprocess and not spec.script:
            bounds.append((t.soft.seconds, "the in-process soft timeout", "--soft-timeout"))
        for bound, what, flag in bounds:
            _over(
                found,
                step,
                bound,
                f"a step takes ~{step:g} s (measured) but {what} is {bound:g} s",
                "every step would be killed",
                f"raise {flag} above {2 * step:.0f}",
            )
    if spec.script and t.gpu and not t.sections():
        found.append(
            Finding(
                False,
                f"the script has no NVRx section timeouts: a hang is found only after the "
                f"heartbeat timeout ({t.heartbeat.seconds:g} s)",
                "bound its sections (--section-timeouts NAME:SECONDS), or its heartbeats "
                "(--heartbeat-timeout)",
            )
        )


def _over(found: list[Finding], need: float, bound: float, problem: str, effect: str, fix: str) -> None:
    """A refusal where ``need`` does not fit in ``bound``; a warning where it leaves less than a fifth."""
    if need >= bound:
        found.append(Finding(True, f"{problem}: {effect}", fix))
    elif need >= 0.8 * bound:
        found.append(Finding(False, f"{problem}: less than a fifth to spare", fix))


def _section_findings(spec: JobSpec, t: Timeouts, release: NVRx | None, found: list[Finding]) -> None:
    """A script's sections against the timeouts ft_launcher has (see :mod:`.sections`)."""
    configured: dict[str, float | None] = dict(t.sections())
    if spec.ft.cfg_path:
        cfg = read_ft_config(spec.ft.cfg_path)
        if cfg.error is None:
            configured = {**cfg.sections, **configured}
        elif t.sections():
            found.append(
                Finding(
                    False,
                    f"--ft-cfg-path {spec.ft.cfg_path}: {cfg.error}, so its sections "
                    "cannot be merged: ft_launcher's --ft-rank-section-timeouts replaces them",
                    "list every section in one place (--section-timeouts, or the file)",
                )
            )
        else:
            configured = {**configured, "*": None}  # not known here: no section is said missing
    if not spec.script:
        return
    opened = script_sections(spec.script)
    if opened is None:
        return  # the script is not readable here (a cluster's image): doctor checks it where it runs
    if not opened and t.out_of_section is not None:
        found.append(
            Finding(
                True,
                f"the script opens no NVRx section, so all of it runs out of section, "
                f"which is bounded to {t.out_of_section.seconds:g} s",
                "drop --out-of-section-timeout, or open sections in the script",
            )
        )
    lost = [] if "*" in configured else missing(opened, configured)
    if not lost:
        return
    names = ", ".join(lost)
    fix = f"add --section-timeouts {','.join(f'{n}:SECONDS' for n in lost)}"
    if release is not None and release.unknown_section_fails:
        found.append(
            Finding(
                True,
                f"the script opens NVRx section(s) {names}, which ft_launcher has no timeout "
                f"for: NVRx {release.version} fails the rank that opens one ('Unknown section')",
                fix,
            )
        )
        return
    which = (
        f"NVRx {release.version} leaves them unbounded (their time counts as out-of-section)"
        if release is not None
        else "NVRx 0.4.1 fails the rank that opens one; 0.5+ leaves them unbounded"
    )
    found.append(
        Finding(
            False,
            f"the script opens NVRx section(s) {names}, which ft_launcher has no timeout for: {which}, "
            "and a script that computes their timeouts fails with KeyError",
            fix,
        )
    )


def _scheduler(spec: JobSpec, t: Timeouts, rows: list[RowDict], found: list[Finding], config: Any) -> None:
    """What the cluster adds: the SIGTERM grace (EKS), KillWait and --signal (Slurm), Kueue."""
    save = max(t.save_s, spec.ft.save_time or 0.0)
    if spec.backend == "eks":
        _row(
            rows,
            "pod grace period",
            t.grace.seconds + 30,
            "SIGTERM to SIGKILL of a pod (a drain, a preemption)",
            "the grace period + 30 s (terminationGracePeriodSeconds)",
        )
        if spec.eks.queue:
            _row(
                rows,
                "Kueue waitForPodsReady",
                None,
                "Kueue evicts a workload whose pods are not all ready",
                "the cluster's Kueue Configuration, not read here: off by default; on, "
                f"{facts.KUEUE_PODS_READY_S:g} s unless set",
            )
        elif spec.nnodes + spec.spare_nodes > 1:
            found.append(
                Finding(
                    False,
                    f"without --queue, one Pending pod makes the others wait "
                    f"{facts.RDZV_JOIN_S:g} s at the rendezvous, then burn their restarts",
                    "submit through Kueue (--queue NAME), which starts all pods or none",
                )
            )
    elif spec.backend == "slurm":
        from ..backends.slurm import engine_parts

        config = facts.slurm_config() if config == "read" else config
        kill = facts.kill_wait(config)
        script = engine_parts.of(spec).render(spec)   # its engine's own script: the --signal it asks for
        lead = facts.signal_lead([line for line in script.splitlines() if line.startswith("#SBATCH")])
        _row(
            rows,
            "Slurm KillWait",
            kill.seconds,
            "Slurm's SIGTERM to SIGKILL (a cancel, the time limit)",
            kill.source,
        )
        _row(
            rows,
            "Slurm --signal lead",
            lead.seconds,
            "Slurm signals the job this long before its time limit",
            lead.source,
        )
        _row(
            rows,
            "Slurm GraceTime",
            facts.SLURM_GRACE_TIME_S,
            "a preemption's SIGTERM to SIGKILL",
            "Slurm's default; set per partition",
        )
        if kill.seconds is not None and kill.seconds < save:
            found.append(
                Finding(
                    False,
                    f"a save takes ~{save:.0f} s but Slurm sends SIGKILL {kill.seconds:g} s "
                    f"after SIGTERM (KillWait, {kill.source}): a cancel's or preemption's save "
                    "is cut",
                    "raise KillWait (slurm.conf), and rely on the last committed save",
                )
            )


def measured(mon: Any) -> tuple[float | None, float | None]:
    """What a job's events measured (a :class:`~eksft_nb.monitor.JobMonitor`): a step (the median of its step
    times, each incarnation's first step aside: it carries the start-up; the median, so the steps an
    injected slow-rank fault or a restart stretched do not make it) and a save (the longest from begin to
    commit); None where it has none. The step section's timeout is a multiple of it (see timeouts)."""
    steps = mon.steps
    times = [
        t for i, t in enumerate(steps.step_time) if t > 0 and not (i and steps.step[i] <= steps.step[i - 1])
    ]  # a restart's first step aside
    times = sorted(times[1:])
    saves = [c.t_done - c.t_begin for c in mon.saves if c.t_done is not None and c.t_begin is not None]
    return _seconds(times[len(times) // 2]) if times else None, _seconds(max(saves)) if saves else None


def _seconds(value: float) -> float:
    """Tenths of a second, and three significant figures below one: a tiny model's step (a few
    milliseconds) is small, never zero."""
    return round(value, 1) if value >= 1 else float(f"{value:.3g}")
