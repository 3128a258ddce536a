"""A local job's ``ft_launcher``: a standby for the next attempt, or one started at once; and its
``nvrx-control`` (NVRx 0.6+'s store host outside the launchers, for hot spares).

Starting ft_launcher costs about two seconds of Python and torch imports, which a job-level
restart would otherwise pay after a node is lost. The supervisor starts this process while the
current attempt trains: it imports the launcher, then waits for one line on stdin with the
attempt's argv and environment and becomes that ft_launcher. End of input means it is not needed.
With arguments (``python -m eksft_nb.backends.local.standby ft_launcher ARGS...``, or ``nvrx-control
ARGS...``) it is that process at once. Either way the stores it hosts listen on loopback only (see
:mod:`eksft_nb.loopback`).

Run as ``python -m eksft_nb.backends.local.standby`` (the supervisor does this).
"""

from __future__ import annotations

import json
import os
import sys

from ...loopback import install


def main() -> int:
    if sys.argv[1:2] == ["nvrx-control"]:
        from nvidia_resiliency_ext.fault_tolerance.control_plane import main as control_main

        install()
        control_main(sys.argv[2:])   # exits
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as ft_launcher_main

    install()
    if len(sys.argv) > 1:
        sys.argv = sys.argv[1:]
        return ft_launcher_main()
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
