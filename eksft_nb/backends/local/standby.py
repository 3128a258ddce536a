"""A standby ``ft_launcher`` for a job's next attempt.

Starting ft_launcher costs about two seconds of Python and torch imports, which a job-level
restart would otherwise pay after a node is lost. The supervisor starts this process while the
current attempt trains: it imports the launcher, then waits for one line on stdin with the
attempt's argv and environment and becomes that ft_launcher. End of input means it is not needed.

Run as ``python -m eksft_nb.backends.local.standby`` (the supervisor does this).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_launcher_main

    order = sys.stdin.readline()
    if not order:
        return 0
    command = json.loads(order)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(command["env"])
    sys.argv = command["argv"]
    return ft_launcher_main()


if __name__ == "__main__":
    sys.exit(main())
