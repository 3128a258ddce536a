"""Sharded checkpoints: DCP format, NVRx's persistent async writer, commit records, safe loading.

A save has three stages, like torchtitan's and Megatron's async checkpointing:

1. **stage** (blocks training): copy into reused shared-memory buffers (:mod:`.staging`), with the
   DCP plan agreed once while the layout stays the same (:mod:`.plan`), and hand the write to NVRx's
   ``PersistentAsyncCaller`` (:mod:`.writer`, a writer process per rank).
2. **write** (background): NVRx writes and fsyncs this rank's shard; each file's size and SHA-256
   go to ``manifest-<rank>.json``.
3. **commit** (collective, at a step boundary once every write is done): rank 0 writes ``.metadata``
   and then ``commit.json`` atomically (:mod:`.manager`). Only a folder with a ``commit.json`` is a
   checkpoint, so a crash before leaves the previous one loadable.

Loading verifies sizes and checksums first, then loads through :mod:`.safe_load`, which trusts
only what commit.json lists and unpickles nothing but DCP's own metadata records.

The writer and the staging buffers outlive a manager (:class:`CheckpointProcess`, owned by the rank
process's session); :mod:`.state` holds :class:`ModelState`, :mod:`.storage_faults` the injected
storage faults. Laid out like torchtitan's ``checkpointer/`` package.
"""

from __future__ import annotations

from typing import Any

# imported on first use: the writer process runs :mod:`.writer` as its main module, which the package
# must not have imported before (runpy warns of it on the ranks' stderr)
_EXPORTS = {"CheckpointManager": ".manager", "CheckpointProcess": ".process", "ModelState": ".state",
            "load": ".safe_load", "read_metadata": ".safe_load", "resume_candidates": ".resume",
            "job_uid": ".resume"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
