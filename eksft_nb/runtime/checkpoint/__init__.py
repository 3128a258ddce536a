"""Sharded checkpoints for one rank: see :mod:`.manager`."""

from .manager import CheckpointManager, ModelState, load, read_metadata, start_writer, stop_writer

__all__ = ["CheckpointManager", "ModelState", "load", "read_metadata", "start_writer", "stop_writer"]
