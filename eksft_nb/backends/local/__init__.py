"""The local backend: real ranks on this machine, each job under a detached supervisor (see
:mod:`.backend`)."""

from .backend import LocalBackend

__all__ = ["LocalBackend"]
