"""A reference run made of events (no job runs): what the resilience test's plan and card read of one."""

from __future__ import annotations

from eksft_nb.events import make
from eksft_nb.monitor import JobMonitor

T0 = 1_000_000.0


def reference(ckpt_at: int | None = 5, commit_s: float = 2.5, steps: int = 20) -> JobMonitor:
    """A reference run of 1 s steps whose save at ``ckpt_at`` commits ``commit_s`` after it begins."""
    evs = [make("job_start", "j", t=T0, spec_digest="x", world_size=2, steps=steps, backend="local", host="h",
                pid=1)]
    for step in range(1, steps + 1):
        evs.append(make("step", "j", rank=0, t=T0 + step, step=step, loss=1.0 / step, tokens=8,
                        step_time=1.0))
    if ckpt_at:
        evs.append(make("checkpoint", "j", rank=0, t=T0 + ckpt_at, phase="begin", step=ckpt_at, mode="async"))
        evs.append(make("checkpoint", "j", rank=0, t=T0 + ckpt_at + commit_s, phase="committed", step=ckpt_at,
                        mode="async", blocked_s=0.1, background_s=commit_s))
    mon = JobMonitor()
    mon.update(sorted(evs, key=lambda e: e.t))
    return mon
