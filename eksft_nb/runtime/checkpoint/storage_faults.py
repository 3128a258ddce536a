"""Injected storage faults (``save-failure``, ``disk-full``, ``slow-storage``), applied to the files a
checkpoint write is about to create: by the async writer process, the sync writer and the commit."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def apply(fault: tuple[str, float] | None, data: list[str], other: tuple[str, ...] = ()) -> None:
    """Injected storage faults, applied to the files a write is about to create (``data``: the
    checkpoint's data files, ``other``: the records written with them):

    - ``fail`` (``save-failure``): partial data files, then an error;
    - ``full`` (``disk-full``): each file becomes a link to ``/dev/full``, so the real writes into it
      fail with the kernel's ENOSPC;
    - ``slow`` (``slow-storage``): the write starts ``value`` seconds late."""
    kind, value = fault or ("", 0.0)
    if kind == "fail":
        for path in data:
            Path(path).write_bytes(b"partial")
        raise OSError("injected save failure: the checkpoint write failed")
    if kind == "full":
        for path in [*data, *other]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.symlink("/dev/full", path)
    if kind == "slow":
        time.sleep(value)


def sync_writer(path: Path, fault: tuple[str, float] | None) -> Any:
    """DCP's FileSystemWriter for a sync save, with an injected storage fault applied to the file this
    rank writes (one writer thread: ``<prefix>0.distcp``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            apply(fault, [str(Path(self.path) / f"{plan.storage_data.prefix}0.distcp")])
            return super().write_data(plan, planner)

    return Writer(str(path), thread_count=1)
