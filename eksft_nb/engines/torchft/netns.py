"""A network of the Lighthouse's own: ``python netns.py -- COMMAND... --bind HOST:PORT ...``.

torchft's Lighthouse accepts any peer that reaches its port: joins to its quorum, its status page, its kill
route. On a shared machine (a local job's loopback, a Slurm node) only a network namespace makes a port
that no other user reaches. This launcher listens on the command's ``--bind HOST:PORT`` in the job's
network (the gateway's front, which answers only the job's processes: :mod:`.gateway`), then moves itself
into a new user and network namespace (unprivileged: the kernel maps this user to itself) whose loopback is
up and reachable from nowhere else, and executes ``COMMAND... --listen-fd N`` there, N the front's socket.
The gateway then runs the Lighthouse on that private loopback.

Run by its path, not as a module: ``unshare`` must be called while the process has one thread, before
the package's imports start any (numpy's thread pool does). ``--probe`` only says whether this machine
allows it (exit 0), else why not (one line on stderr, exit 1).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
FIX = ("allow unprivileged user namespaces (Debian: sysctl kernel.unprivileged_userns_clone=1; Ubuntu: "
       "sysctl kernel.apparmor_restrict_unprivileged_userns=0; a container: a seccomp profile that "
       "allows unshare), or use --engine nvrx")


def isolate() -> None:
    """Move this process (one thread) into a new user and network namespace, loopback up; OSError with a
    one-line reason if the machine does not allow it."""
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        why = {errno.EPERM: "not permitted here", errno.EINVAL: "the process has more than one thread",
               errno.ENOSPC: "the user namespace limit is reached",
               errno.EUSERS: "the user namespace limit is reached"}.get(code, os.strerror(code))
        raise OSError(code, f"cannot make a private network namespace for torchft's Lighthouse ({why})")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def listen(bind: str) -> socket.socket:
    """A TCP socket listening on ``bind`` (``host:port``, an IPv6 host in brackets) and nowhere else."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(socket.SOMAXCONN)
    return sock


def main(argv: list[str]) -> int:
    if argv == ["--probe"]:
        try:
            isolate()
        except OSError as e:
            print(f"{e.strerror}: {FIX}", file=sys.stderr)
            return 1
        return 0
    binds = [argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--bind"]
    if len(argv) < 2 or argv[0] != "--" or len(binds) != 1:
        print("usage: python netns.py -- COMMAND... --bind HOST:PORT ...", file=sys.stderr)
        return 2
    try:
        front = listen(binds[0])
    except (OSError, ValueError) as e:
        print(f"eksft: error: the Lighthouse's gateway cannot listen on {binds[0]} ({e}): pick another port",
              file=sys.stderr)
        return 1
    try:
        isolate()
    except OSError as e:
        print(f"eksft: error: {e.strerror}: {FIX}", file=sys.stderr)
        return 1
    os.set_inheritable(front.fileno(), True)
    command = [*argv[1:], "--listen-fd", str(front.fileno())]
    os.execv(command[0], command)
    return 1   # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
