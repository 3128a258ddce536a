"""Which NVRx (nvidia-resiliency-ext) this environment has, and what that release can do.

eksft supports NVRx 0.4.1 and later. The releases differ in ways the launch line, the in-process
tier, hot spares and the restart timeline have to follow; this module is the one place that knows how:

- 0.5: barrier rendezvous (the default from then on), async checkpoint writer without fork;
- 0.6: ``inprocess.Wrapper`` deprecated in favour of in-job restart; hot spares of its own (standby
  nodes: ``--nnodes MIN:MAX``, the first MIN to join active, the rest waiting for a lost node's place)
  and ``nvrx-control``, a store host outside the launchers; per-cycle records (``NVRxCycleInfo`` files
  under ``--ft-cycle-info-dir``, see :mod:`.nvrx_cycles`); progress-based early termination
  (``--ft-max-no-progress-cycles``); ``--ft-restart-policy`` a no-op;
- 0.7 (wheels for Python 3.12 and 3.14 only; its sources run on 3.11): legacy rendezvous and
  ``--ft-restart-policy`` gone.

Every release takes the same section flags (``--ft-rank-section-timeouts``,
``--ft-rank-out-of-section-timeout``); a section without a timeout fails its rank in 0.4.x and goes
unbounded from 0.5. Capabilities follow the version, except the in-process tier, which is looked up
as a module: a release that drops ``nvidia_resiliency_ext.inprocess`` loses it whatever its number says.

What a release cannot run of a spec is decided here, once (:meth:`NVRx.cannot_run`): a local launch asks
it, and so does ``doctor``, the gate of an EKS pod's prepare step and of a Slurm allocation's watcher.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import JobError

if TYPE_CHECKING:
    from .spec import JobSpec

DIST = "nvidia-resiliency-ext"
OLDEST = (0, 4, 1)
OWN_SPARES = (0, 6, 0)   # standby nodes (--nnodes MIN:MAX) and nvrx-control: NVRx's own hot spares


@dataclass(frozen=True)
class NVRx:
    """One NVRx release and what eksft uses of it."""

    version: str
    inprocess_module: bool = True  # nvidia_resiliency_ext.inprocess is importable

    @property
    def release(self) -> tuple[int, int, int]:
        return parse_version(self.version)

    @property
    def inprocess(self) -> str:
        """``available``, ``deprecated`` (0.6+: still works, no longer developed) or ``missing``."""
        if not self.inprocess_module:
            return "missing"
        return "deprecated" if self.release >= (0, 6, 0) else "available"

    @property
    def rendezvous(self) -> str:
        """ft_launcher's default rendezvous: ``legacy`` (up to 0.4), ``barrier`` (0.5, 0.6: legacy still
        selectable) or ``barrier only`` (0.7). eksft passes neither ``--ft-rdzv-impl`` nor
        ``--ft-restart-policy`` (gone in 0.7), so one launch line fits them all."""
        if self.release < (0, 5, 0):
            return "legacy"
        return "barrier" if self.release < (0, 7, 0) else "barrier only"

    @property
    def cycle_records(self) -> bool:
        """ft_launcher writes one ``NVRxCycleInfo`` JSON file per restart cycle when asked to."""
        return self.release >= (0, 6, 0)

    @property
    def progress_termination(self) -> bool:
        """ft_launcher can end a job whose restarts make no progress (``--ft-max-no-progress-cycles``)."""
        return self.release >= (0, 6, 0)

    @property
    def spares(self) -> str | None:
        """How a hot spare takes a lost node's place with this release: ``standby`` (0.6+: NVRx's own
        standby nodes, ``--nnodes MIN:MAX``), ``handover`` (0.4: the legacy rendezvous keeps spares in a
        redundancy list; a local job's supervisor hands the lost node's place over at once, see
        ``backends.local.handover``), or None (0.5: its barrier rendezvous counts a spare against
        ``--nnodes`` and closes the job when it joins, and its standby nodes count in the world size)."""
        if self.release >= OWN_SPARES:
            return "standby"
        return "handover" if self.rendezvous == "legacy" else None

    @property
    def spares_refused(self) -> str | None:
        """Why a local job's hot spares cannot work with this release; None where they do."""
        if self.spares is not None:
            return None
        return (f"NVRx {self.version}'s {self.rendezvous} rendezvous counts a hot spare against --nnodes and "
                "closes the job when it joins, so a spare never takes a lost node's place")

    def cannot_run(self, spec: JobSpec) -> JobError | None:
        """Why this release cannot run ``spec`` as rendered for its backend (one line: what, then the fix),
        else None. A cluster's launch line gives spares NVRx's own standby nodes (``--nnodes N:N+S``),
        which only 0.6+ reads so (0.4 would train on every spare); locally 0.4's spares work through the
        supervisor's handover, 0.5's nowhere."""
        if not spec.spare_nodes or (spec.backend == "local" and self.spares == "handover"):
            return None
        if self.spares == "standby":
            if spec.nnodes > 1:
                return None
            # a lost node's survivors open the rendezvous's next round, which a standby node joins
            return JobError(f"--spare-nodes {spec.spare_nodes} with --nnodes 1: NVRx {self.version}'s "
                            "standby nodes take a lost node's place when the nodes that survived it restart, "
                            "and one node leaves none", "use --nnodes 2 or more, or --spare-nodes 0 (a lost "
                            "node is then a job restart)")
        why = (f"NVRx {self.version} takes --nnodes {spec.nnodes}:{spec.nnodes + spec.spare_nodes} as an "
               "elastic range and would train on every spare" if self.spares == "handover"
               else self.spares_refused)
        return JobError(f"--spare-nodes {spec.spare_nodes}: {why}",
                        "use NVRx >= 0.6 (pip install 'nvidia-resiliency-ext>=0.6'; Python 3.12 resolves "
                        "0.7), or --spare-nodes 0 (a lost node is then a job restart)")

    @property
    def unknown_section_fails(self) -> bool:
        """A rank that opens a section the config has no timeout for fails (``Unknown section: NAME``,
        0.4.x); from 0.5 the client skips such a section, leaving its time to the out-of-section timeout.
        Every release takes the section flags eksft gives (``--ft-rank-section-timeouts``,
        ``--ft-rank-out-of-section-timeout``: one name from 0.4.1 to 0.7)."""
        return self.release < (0, 5, 0)

    def nccl_problem(self, nccl: tuple[int, int, int] | None, inprocess: bool) -> str | None:
        """What NVRx's release notes say of this NCCL with in-process restart; None where nothing."""
        if nccl is None or not inprocess or self.inprocess == "missing":
            return None
        if (2, 28, 3) <= nccl <= (2, 28, 8):
            return (f"NCCL {'.'.join(map(str, nccl))} crashes NVRx's in-process restart (a segfault: NVRx "
                    "asks for NCCL < 2.28.3 or >= 2.28.9)")
        if nccl < (2, 24, 1):
            return (f"NCCL {'.'.join(map(str, nccl))} initialises its net plugin twice under NVRx's "
                    "in-process restart: NVRx asks for NCCL_NET_PLUGIN=none below 2.24.1")
        return None

    def launcher_flags(self, cycle_dir: str | None = None) -> list[str]:
        """Flags only this release's ft_launcher takes. eksft's supervisor judges progress itself
        (``ft.progress_patience``), so NVRx's own no-progress cut-off is turned off."""
        flags = []
        if self.progress_termination:
            flags.append("--ft-max-no-progress-cycles=0")
        if self.cycle_records and cycle_dir:
            flags.append(f"--ft-cycle-info-dir={cycle_dir}")
        return flags

    def inprocess_note(self) -> str | None:
        """One line for users when asking for in-process restart is not plainly fine; else None."""
        if self.inprocess == "deprecated":
            return (f"NVRx {self.version} deprecates in-process restart (inprocess.Wrapper); it still runs, "
                    "but in-job restart is NVRx's way forward (--no-inprocess)")
        if self.inprocess == "missing":
            return (f"NVRx {self.version} has no in-process restart (inprocess.Wrapper): "
                    "exceptions and hangs restart the worker group in-job instead")
        return None

    def describe(self) -> str:
        tiers = {"available": "in-process, in-job, job", "deprecated": "in-process (deprecated), in-job, job",
                 "missing": "in-job, job"}[self.inprocess]
        return f"NVRx {self.version} (restart tiers: {tiers}; {self.rendezvous} rendezvous)"


def parse_version(text: str) -> tuple[int, int, int]:
    """``0.6.0``, ``0.7.0rc1``, ``0.5.0+cu13`` -> (major, minor, patch); unparsable -> (0, 0, 0)."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", text if isinstance(text, str) else "")
    if m is None:
        return (0, 0, 0)
    return tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


def supports_own_spares(version: str) -> bool:
    """Whether NVRx ``version`` has hot spares of its own (standby nodes, ``--nnodes MIN:MAX``): what a
    cluster's launch line asks of the NVRx where the job runs."""
    return NVRx(version).spares == "standby"


def require() -> NVRx:
    """The installed NVRx, if eksft supports it; else a JobError saying how to get one."""
    from .preflight import platforms

    here = installed()
    if here is None or here.release < OLDEST:
        found = (f"NVRx {here.version} is older than" if here
                 else "NVRx (nvidia-resiliency-ext) is not installed; need")
        python, libc = platforms.here()
        fix = ("pip install 'nvidia-resiliency-ext>=0.4.1,<0.8' into the environment that runs eksft"
               if platforms.resolves(python, libc) else platforms.said(python, libc))
        raise JobError(f"{found} {'.'.join(map(str, OLDEST))}", fix)
    return here


@functools.lru_cache(maxsize=1)
def installed() -> NVRx | None:
    """The NVRx this interpreter imports (the first on ``sys.path``, as ``import`` finds it), or None."""
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        has_inprocess = importlib.util.find_spec("nvidia_resiliency_ext.inprocess") is not None
    except (ImportError, ValueError):
        has_inprocess = False
    return NVRx(version, has_inprocess)
