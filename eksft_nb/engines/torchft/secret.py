"""A torchft job's secret: the key every one of its servers requires before it answers, and every client
proves it holds (:mod:`.wire`), so that no process outside the job joins its quorum, reads its state or
feeds it one.

Where it lives (never on a command line, never in an environment variable's value):

- ``local`` and ``slurm``: ``<job folder>/torchft/secret``, mode 0600 in the job's 0700 folder (on Slurm
  the folder is on the shared disk every node reads). The first of the job's processes that needs it
  (the Lighthouse's gateway or a replica group) makes it, atomically: the others read that one;
- ``eks``: a Kubernetes Secret of the job, mounted read-only into the Lighthouse's pod and the groups'
  (its path in :data:`ENV`).

It is 32 random bytes, written as 64 hex digits. A file that is not a regular file, or that others could
have written or read, is refused in one line: the job folder's must be this user's with no permission for
anyone else; a Secret's mount (root's or this user's) may be read by the pod's group (an ``fsGroup``, for an
image whose user is not root), nothing more.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from ...errors import JobError

ENV = "EKSFT_TORCHFT_SECRET"   # the key file's path, where it is not the job folder's (EKS: the mount)
NAME = "secret"
BYTES = 32
_FIX = "run the job again (a new job makes a new secret); do not share the job folder with other users"


def key(env: Mapping[str, str] | None = None) -> bytes:
    """This process's job's key: the mounted file :data:`ENV` names, else its job folder's (made if it is
    the first to need it)."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return load(Path(env[ENV]), mounted=True)
    return ensure(Path(env["EKSFT_JOB_DIR"]) / "torchft" / NAME)


def generate() -> str:
    """A new key, as the file holds it (64 hex digits)."""
    return secrets.token_hex(BYTES)


def ensure(where: Path) -> bytes:
    """The key at ``where``, made there first if there is none (0600; of processes racing to make it, the
    first to link its file wins and every one reads that)."""
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not where.exists():
        tmp = where.with_name(f".{NAME}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(generate() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, where)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    return load(where)


def load(where: Path, mounted: bool = False) -> bytes:
    """The key at ``where``, checked (see the module's docstring; ``mounted``: a Secret's mount); one line if
    it is missing or unsafe."""
    # a Secret's mount is a link into its ..data folder: the file it resolves to is what must be private
    real = Path(os.path.realpath(where))
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise JobError(f"the torchft job's secret {where} cannot be read ({e.strerror or e})", _FIX) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobError(f"the torchft job's secret {where} is not a regular file", _FIX)
        shared = st.st_mode & (stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP if mounted else 0o077)
        if st.st_uid not in ((os.geteuid(), 0) if mounted else (os.geteuid(),)) or shared:
            raise JobError(f"the torchft job's secret {where} is shared with other users (owner "
                           f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})", _FIX)
        raw = os.read(fd, 2 * BYTES + 2)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != BYTES:
        raise JobError(f"the torchft job's secret {where} is not {2 * BYTES} hex digits", _FIX)
    return key
