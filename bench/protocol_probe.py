"""A training script for the overhead benchmark: times the per-step protocol where it really runs,
under ft_launcher (so an NVRx heartbeat is a round trip to the launcher's rank monitor).

``python -m eksft_nb.runtime.script bench/protocol_probe.py OUT N``: rank 0 writes to OUT the
microseconds per call, in 5 batches of N/5, of a heartbeat and of step_begin+step_end.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable


def per_call_us(fn: Callable[[int], object], n: int, batches: int = 5) -> list[float]:
    out, i = [], 0
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n // batches):
            i += 1
            fn(i)
        out.append((time.perf_counter() - t0) / (n // batches) * 1e6)
    return out


def main() -> None:
    from eksft_nb.runtime import session

    out, n = sys.argv[1], int(sys.argv[2])
    s = session()
    if s.monitor is None or s.monitor.client is None:
        raise SystemExit("not under ft_launcher: no heartbeats to time")

    def step(i: int) -> None:
        s.step_begin(i)
        s.step_end(i, 1.0, 1, 0.1)

    for _ in range(n // 5):  # untimed first: a rank forked from a warm zygote touches its pages afresh
        s.heartbeat()
    result = {"heartbeat_us": per_call_us(lambda i: s.heartbeat(), n),
              "step_protocol_us": per_call_us(step, n)}
    if s.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
