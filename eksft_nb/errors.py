"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations


class EksftError(Exception):
    """An error a user can act on. ``str()`` is one line: what is wrong, then what to do."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem.rstrip(".")
        self.fix = fix.rstrip(".")
        super().__init__(f"{self.problem}: {self.fix}" if self.fix else self.problem)


class SpecError(EksftError):
    """A job spec (or an option that sets one) is invalid."""


class JobError(EksftError):
    """A job-level operation cannot be done (unknown job, finished job, missing checkpoint...)."""


class UnknownJobError(JobError):
    """No job of that name (the server extension answers 404)."""


class ControlError(EksftError):
    """A control command (fault, stop, resume) is malformed or does not apply."""
