"""The built-in trainer's entry point: a GPT decoder under FSDP2, fault tolerant with NVRx's three tiers.

ft_launcher runs this module on every rank (``python -m eksft_nb.runtime.trainer_main``):

- ``inprocess.Wrapper`` (when ``ft.inprocess``) turns exceptions and hangs into in-process
  restarts: the process group is rebuilt on a fresh store prefix, the model is rebuilt and the last
  committed checkpoint is loaded, all inside the same process;
- ft_launcher's heartbeats and NVRx sections (setup, step, checkpointing: on GPUs by default, see
  :mod:`eksft_nb.timeouts`) turn dead or hung ranks into in-job restarts of the whole worker group;
- the job supervisor relaunches ft_launcher when a whole node (launcher) dies.

This module stays light (torch is imported by ``main``): the checkpoint writer's helper processes
are spawned, and a spawned process re-imports the main module.
"""

from __future__ import annotations

import gc
import os
import time
from types import ModuleType
from typing import Any

from .quiet import quiet_process


def main() -> None:
    quiet_process()
    import torch

    from ..loopback import install
    from .drain import Drain
    from .session import session
    from .trainer import run, wrapper_kwargs

    install()   # the stores rank 0 hosts (the trainer's, the Wrapper's) listen on loopback in a local job
    s = session()
    s.setup_begin()   # from here the start-up is bounded by the "setup" section (where the spec has one)
    s.drain = Drain().install()   # SIGTERM: save, commit and stop at the next step boundary
    try:
        if s.spec.checkpoint.mode == "async":
            # spawning the writer's processes blocks this thread for seconds on a busy machine:
            # do it before the in-process Wrapper starts timing progress
            s.checkpointing().writer.start()
        inprocess = wrapper_module(s) if s.spec.ft.inprocess and "EKSFT_WRAPPER_PORT" in os.environ else None
        if inprocess is not None:
            s.t_wrapper_setup = time.time()   # reported at the wrapped function's first call
            from .peers import track

            track()

            # the Wrapper passes itself to the parameter annotated with CallWrapper (a real class,
            # not the string that `from __future__ import annotations` leaves)
            run.__annotations__["call_wrapper"] = inprocess.CallWrapper
            wrapper = inprocess.Wrapper(**wrapper_kwargs(s))
            if hasattr(wrapper, "restart_health_check") and not torch.cuda.is_available():
                # NVRx 0.6+ chains its GPU, NVLink and NIC checks into every in-process restart;
                # with no GPU they can only fail, turning each restart into an exit
                wrapper.restart_health_check = None
            # between restarts the Wrapper collects garbage until there is none: full collections over
            # every object torch's import made (0.15-0.3 s each here). What exists now lives as long as
            # the process anyway: freezing it leaves those collections only the restarts' own objects
            # (no collection first: it would cost every fresh rank 0.07 s to free a few objects)
            gc.freeze()
            wrapper(run)()
            if s.t_wrapped_return is not None:   # the Wrapper's completion, after the training returned
                s.emit("inprocess_wrapper", phase="exit", seconds=max(0.0, time.time() - s.t_wrapped_return))
        else:
            run()
    finally:
        s.close()
    exit_cleanly()


def wrapper_module(s: Any) -> ModuleType | None:
    """NVRx's ``inprocess`` module, or None where this NVRx has none that imports (deprecated since 0.6,
    to be removed): the rank then trains without the Wrapper, its exceptions and hangs restart the worker
    group in-job, and rank 0 says so once, as a warning the job's summary carries. The render of a pod
    or a Slurm node cannot know the NVRx there: this is where it is found out."""
    try:
        import nvidia_resiliency_ext.inprocess as inprocess
    except ImportError as e:
        if s.rank == 0 and not (s.info.injob_restart or s.info.job_attempt):
            s.warn("inprocess_missing", f"in-process restart is off: this NVRx has no inprocess.Wrapper that "
                   f"imports ({type(e).__name__}: {e}); exceptions and hangs restart the worker group in-job "
                   "instead")
        return None
    return inprocess


def exit_cleanly() -> None:
    """End a rank that finished: Python's exit handlers run (the checkpoint writer stops), then the
    process leaves without tearing down the interpreter. That teardown destroys torch.distributed's
    C++ objects and now and then aborts ("terminate called without an active exception"); ft_launcher
    would take the finished rank for a failed one and restart the worker group."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
