"""Runs a user's training script on a rank, under the same launcher as the built-in trainer.

``python -m eksft_nb.runtime.script SCRIPT [ARGS...]``: quiets library noise, records the rank's
start, exceptions and exit in the job's events (so even a script that knows nothing of eksft-nb
shows its restarts and exit codes), then runs the script as ``__main__``. Scripts that want more
use :func:`eksft_nb.runtime.session` for heartbeats, step telemetry and fault commands.
"""

from __future__ import annotations

import os
import runpy
import sys

from .quiet import quiet_process
from .train import exit_cleanly


def main() -> None:
    quiet_process()
    if len(sys.argv) < 2:
        sys.exit("usage: python -m eksft_nb.runtime.script SCRIPT [ARGS...]")
    from .session import session

    s = session()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    s.rank_start(0, script=os.path.basename(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            s.emit("rank_error", error=f"exit code {code}", step=s.step_entered or None, origin="exception")
        s.emit("rank_end", final_step=s.step_done, exit_code=code)
        s.close()
        raise
    except BaseException as e:
        s.rank_error(e)
        s.close()
        raise
    s.emit("rank_end", final_step=s.step_done, exit_code=0)
    s.close()
    exit_cleanly()


if __name__ == "__main__":
    main()
