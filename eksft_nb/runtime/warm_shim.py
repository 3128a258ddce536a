"""The worker command of a warm job: turns into a rank forked by the node's zygote (see :mod:`.zygote`).

ft_launcher runs ``python -S warm_shim.py -m MODULE ARGS...`` (a file, no site, standard library only:
it starts in tens of milliseconds) with ``EKSFT_WARM_SOCKET`` (the zygote's socket, a path in a 0700
folder) and ``EKSFT_WARM_ZYGOTE`` (its pid) in its environment. The shim hands its argv, environment
(secrets included), working directory and stdio to the zygote, which forks a child that becomes the
rank with torch already imported; so before it sends anything, it checks that the process listening
on that path is that zygote, of its own user (``SO_PEERCRED``). To ft_launcher the shim *is* the
rank: catchable signals are passed on to the rank's process group, the shim exits with the rank's
status (dying of the same signal when the rank did), and when the shim is SIGKILLed the zygote sees
the connection close and kills the rank.

When there is no zygote (gone, refused, never started) the shim execs the cold command
``python -u -m MODULE ARGS...`` after one line on stderr saying so: the optimisation never fails a job.
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "EKSFT_WARM_SOCKET"
ZYGOTE_ENV = "EKSFT_WARM_ZYGOTE"
SUN_PATH_MAX = 107   # sockaddr_un's 108 bytes, less the final NUL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
REPLY_TIMEOUT_S = 300.0  # a zygote still importing torch on a loaded machine answers late, not never


def cold(why: str) -> None:
    """Become the rank the usual way."""
    print(f"eksft: no warm rank ({why}): starting this rank cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])


def at_path(sock: socket.socket, path: str, listen: bool = False) -> None:
    """Connect ``sock`` to the unix socket at ``path`` (or bind it there, with ``listen``), also when the
    path is longer than a socket address holds (a deep ``EKSFT_HOME``): then through the folder's
    descriptor, ``/proc/self/fd/N/NAME``."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        sock.bind(path) if listen else sock.connect(path)
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        short = f"/proc/self/fd/{fd}/{name}"
        if len(os.fsencode(short)) > SUN_PATH_MAX:
            raise OSError(36, f"socket name {name[:40]!r} is too long")  # ENAMETOOLONG
        sock.bind(short) if listen else sock.connect(short)
    finally:
        os.close(fd)


def peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket, as the kernel recorded them."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def request(conn: socket.socket) -> None:
    env = {**os.environ, "EKSFT_LAUNCHER_PID": str(os.getppid())}  # the rank's parent will be the zygote
    body = json.dumps({"argv": sys.argv[1:], "env": env, "cwd": os.getcwd()}).encode()
    conn.sendmsg([struct.pack("!I", len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                          struct.pack("3i", 0, 1, 2))])


def main() -> None:
    name, expected = os.environ.get(SOCKET_ENV), os.environ.get(ZYGOTE_ENV, "")
    if not name or not expected.isdigit():
        cold(f"{SOCKET_ENV} or {ZYGOTE_ENV} is not set")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        at_path(conn, name)
        pid, uid = peer(conn)
        if (pid, uid) != (int(expected), os.getuid()):   # nothing goes to another process
            conn.close()
            cold(f"zygote {name} is served by pid {pid} of uid {uid}, "
                 f"not by zygote {expected} of uid {os.getuid()}")
        request(conn)
    except OSError as e:
        cold(f"zygote {name}: {e.strerror or e}")
    child = [0]
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child[0]:
            try:
                os.killpg(child[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    reader = conn.makefile("rb")
    conn.settimeout(REPLY_TIMEOUT_S)
    try:
        first = reader.readline().split()
    except OSError:
        first = []
    if len(first) != 2 or first[0] != b"pid":
        cold(f"zygote {name} answered {b' '.join(first).decode(errors='replace') or 'nothing'}")
    conn.settimeout(None)
    child[0] = int(first[1])
    for signum in pending:
        forward(signum, None)
    line = reader.readline().split()
    if len(line) != 2 or line[0] != b"exit":
        # the zygote is gone: the rank must not outlive its worker process
        try:
            os.killpg(child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(f"eksft: the warm-rank zygote {name} went away; rank pid {child[0]} killed", file=sys.stderr,
              flush=True)
        os._exit(1)
    code = os.waitstatus_to_exitcode(int(line[1]))
    if code < 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


if __name__ == "__main__":
    main()
