"""Runs a user's training script on a rank as ``python SCRIPT ARGS`` would, under the same launcher as
the built-in trainer.

``python -m eksft_nb.runtime.script SCRIPT [ARGS...]``: the script's folder comes first on
``sys.path`` (so modules beside it import; for a notebook cell's code, the notebook's folder), ``sys.argv`` is
``[SCRIPT, ARGS...]``, ``__name__`` is ``"__main__"``, and the working directory is the spec's ``workdir``
(for a local job: where it was launched from). Around the script, with no change to it:

- the rank's start, exceptions, in-process restarts (an ``inprocess.Wrapper`` of its own) and exit
  become events, so its restarts and exit codes show;
- a global optimizer-step hook counts steps and times them (rank 0 reports them as ``step`` events,
  loss and tokens unknown) and sends ft_launcher's heartbeats, unless the script sends its own;
- the rank-monitor connection goes to the script when it opens one (see :class:`.session.MonitorLink`);
- fault commands fire at an optimizer step (from the hook) or now / after a delay (from a thread).

A script that uses :func:`eksft_nb.runtime.session`'s step protocol reports its own steps, loss and
faults: the hook then steps aside.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ..jobdir import eksft_home
from ..loopback import install
from .faults import fire_due
from .quiet import quiet_process
from .trainer_main import exit_cleanly

POLL_S = 0.25   # how often the fault thread looks for commands (one stat when nothing changed)


def main(probe_type: type[ScriptProbe] | None = None) -> None:
    """``probe_type``: what watches the script (an engine's :class:`ScriptProbe`; default: NVRx's)."""
    quiet_process()
    if len(sys.argv) < 2:
        sys.exit("usage: python -m eksft_nb.runtime.script SCRIPT [ARGS...]")
    from .session import session

    # the store init_process_group has rank 0 host (env://, from MASTER_ADDR and MASTER_PORT), and any
    # other the script hosts, listen on loopback in a local job
    when_imported("torch", lambda _torch: install())
    s = session()
    if s.spec.checkpoint.mode == "async" and os.environ.get("EKSFT_WARM_RANK") == "1":
        # forked now, while the rank has no process group (see checkpoint.writer._forked_if_warm)
        s.checkpointing().writer.start()
    script = os.path.abspath(sys.argv[1])
    if s.spec.workdir:
        try:
            os.chdir(s.spec.workdir)
        except OSError as e:
            sys.exit(f"eksft: error: cannot enter the working directory {s.spec.workdir}: {e.strerror}\n"
                     "  → set --workdir to a folder that exists where the ranks run")
    sys.argv = [script, *sys.argv[2:]]
    # `python -m` put the working directory there: a script's own folder instead, as `python SCRIPT`
    # does; a notebook cell's code keeps the working directory (the notebook's), as `python -c` does
    cell = Path(script).resolve().parent == (eksft_home() / "scripts").resolve()
    sys.path[0] = os.getcwd() if cell else os.path.dirname(script)
    s.rank_start(0, script=os.path.basename(script))
    # last before the script: a fault it fires lands in the script, reported as one
    probe = (probe_type or ScriptProbe)(s)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            s.emit("rank_error", error=f"exit code {code}", step=s.step_entered or None, origin="exception")
        s.emit("rank_end", final_step=s.step_done, exit_code=code, **probe.ended(code))
        s.close()
        raise
    except BaseException as e:
        s.rank_error(e)
        s.close()
        raise
    finally:
        probe.stop()
    s.emit("rank_end", final_step=s.step_done, exit_code=0, **probe.ended(0))
    s.close()
    exit_cleanly()


class ScriptProbe:
    """What the runner adds to any script: optimizer steps as progress and heartbeats, faults, and
    in-process restarts as events. Steps are counted per incarnation (from 1 after every restart):
    where a script resumes from its own checkpoint is not known from outside."""

    def __init__(self, s: Any) -> None:
        from .faults import FAULT_SIGNAL

        self.s = s
        self.steps = 0
        # when the step being timed began (the first: at its first forward)
        self.t_last = time.perf_counter()
        # the optimizer whose steps count (a script may have several)
        self.primary: weakref.ref | None = None
        self._forward: Any = None
        self._lock = threading.Lock()       # the inbox is shared with the fault thread
        self._halt = threading.Event()
        self.main = threading.main_thread().ident
        signal.signal(FAULT_SIGNAL, s.raise_pending)
        if s.monitor is not None and s.monitor.client is not None:
            s.monitor.yield_to_script()
        when_imported("torch", self._hook_torch)
        when_imported("nvidia_resiliency_ext.inprocess", self._hook_wrapper)
        if s.inbox is not None:
            threading.Thread(target=self._poll, name="eksft-faults", daemon=True).start()

    def stop(self) -> None:
        self._halt.set()

    def ended(self, exit_code: int) -> dict[str, Any]:
        """What the script's ``rank_end`` event adds (an engine's probe: the weights' digest)."""
        return {}

    # ---- steps ------------------------------------------------------------------------------
    def _hook_torch(self, _torch: ModuleType) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self.on_step)
        self._arm()

    def _arm(self) -> None:
        """Time the incarnation's first step from its first forward pass (the hook then goes away)."""
        from torch.nn.modules.module import register_module_forward_pre_hook

        if self._forward is None:
            self._forward = register_module_forward_pre_hook(self._on_forward)

    def _on_forward(self, _module: Any, _args: Any) -> None:
        self._forward.remove()
        self._forward = None
        if self.steps == 0:
            self.t_last = time.perf_counter()

    def on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """After every ``optimizer.step()``, in the main thread."""
        s = self.s
        if s.reports_steps or all(float(g.get("lr", 1.0)) == 0.0 for g in optimizer.param_groups):
            # a step at learning rate 0 trains nothing: DCP's loader takes one to create optimizer state
            return
        primary = self.primary() if self.primary is not None else None
        if primary is None:
            self.primary = weakref.ref(optimizer)
        elif primary is not optimizer:
            return
        if (counted := self.count()) is None:
            return
        now = time.perf_counter()
        (step, report), step_time, self.t_last = counted, now - self.t_last, now
        s.step_entered = s.step_done = step
        s.t_done = time.time()
        s.heartbeat()
        if report:
            self.report(step, step_time)
        s.lingering_faults(step)
        fire_due(s, step + 1, steps_only=True, lock=self._lock)

    def report(self, step: int, step_time: float) -> None:
        """The ``step`` event of a counted step (an engine's probe may decide which of its ranks emits it)."""
        if self.s.instrumented:
            self.s.emit("step", step=step, loss=None, tokens=None, step_time=step_time)

    def count(self) -> tuple[int, bool] | None:
        """The optimizer step just taken: its number, and whether this rank reports it (rank 0); None when
        it does not count (an engine's probe: a step its engine did not commit)."""
        self.steps += 1
        return self.steps, self.s.rank == 0

    # ---- faults now or after a delay --------------------------------------------------------
    def _poll(self) -> None:
        s = self.s
        while not self._halt.wait(POLL_S):
            if s.reports_steps:  # the script's step_begin fires its commands at step starts
                return
            fire_due(s, None, at=self.steps + 1 if self.steps else None, main_thread=self.main,
                     lock=self._lock)

    # ---- in-process restarts of the script's own inprocess.Wrapper --------------------------
    def _hook_wrapper(self, inprocess: ModuleType) -> None:
        """Give every ``inprocess.Wrapper`` the script makes an initialize and a finalize step that
        report each restart iteration (composed with the script's own), and an abort step that
        unblocks gloo collectives at once (see :mod:`.peers`)."""
        from nvidia_resiliency_ext.inprocess.abort import AbortTorchDistributed
        from nvidia_resiliency_ext.inprocess.finalize import Finalize
        from nvidia_resiliency_ext.inprocess.initialize import Initialize

        from .peers import abort_chain, track

        track()

        probe = self

        class Entered(Initialize):
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __call__(self, state: Any) -> Any:
                probe.entered(state.iteration)
                return self.inner(state) if self.inner is not None else state

        class Failed(Finalize):
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __call__(self, state: Any) -> Any:
                if state.fn_exception is not None:
                    probe.s.rank_error(state.fn_exception)
                return self.inner(state) if self.inner is not None else state

        init = inprocess.Wrapper.__init__

        @functools.wraps(init)
        def __init__(wrapper: Any, *args: Any, initialize: Any = None, finalize: Any = None,
                     abort: Any = AbortTorchDistributed(), **kwargs: Any) -> None:
            init(wrapper, *args, initialize=Entered(initialize), finalize=Failed(finalize),
                 abort=abort_chain(abort),
                 **kwargs)
            if hasattr(wrapper, "restart_health_check") and not _has_cuda():
                # NVRx 0.6+ chains its GPU, NVLink and NIC checks after the script's own before every
                # in-process restart; with no GPU they can only fail, turning each restart into an exit
                # (as the built-in trainer's Wrapper, see trainer_main): the script's own check stays
                wrapper.restart_health_check = getattr(wrapper, "health_check", None)

        inprocess.Wrapper.__init__ = __init__

    def entered(self, iteration: int) -> None:
        """The wrapped function starts (again): iteration > 0 is an in-process restart."""
        s = self.s
        s.inprocess_iteration = iteration
        if iteration == 0:
            return
        self.steps, self.primary, self.t_last = 0, None, time.perf_counter()
        self._arm()
        s.rank_start(0, t_enter=time.time(), script=os.path.basename(sys.argv[0]))


# ---- post-import hooks ---------------------------------------------------------------------------

def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported (now, if it already is), so
    the runner imports no more than the script does (NVRx's inprocess, for one, only when it is used)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.pending.setdefault(name, []).append(callback)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Any,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.pending.pop(fullname, None)
        if callbacks is None:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path,
                                    target) if finder is not self and hasattr(finder, "find_spec") \
                else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, callbacks)
        return spec


class _ThenCall(importlib.abc.Loader):
    """A loader that runs the original one, then the callbacks on the loaded module."""

    def __init__(self, inner: Any, callbacks: list[Callable[[ModuleType], None]]) -> None:
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for callback in self.callbacks:
            try:
                callback(module)
            except Exception as e:  # telemetry must never break the script
                print(f"eksft: warning: cannot instrument {module.__name__}: {type(e).__name__}: {e}",
                      file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
