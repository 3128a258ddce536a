"""Warm ranks: a per-node process that imports torch, NVRx and the runtime once and forks ranks.

A fresh rank process spends seconds importing torch before it does anything, and every in-job or
job-level restart starts fresh ranks. The zygote pays that once per node, ahead of time: it listens on
a unix socket, imports, and then waits, with no process group and no thread of its own
(a fork copies only the forking thread). Each :mod:`.warm_shim` that connects gets a forked child
that becomes its rank: own session, the shim's stdio, environment, argv and working directory, then
the module run as ``python -u -m MODULE`` would. The zygote tells the shim the child's pid and, when
it ends, its wait status; when the shim's connection closes (the launcher SIGKILLed its worker) it
kills the child's process group at once.

Processes a rank forks (the checkpoint writer) carry the zygote's start-up environment (the job's
mark) in ``/proc/PID/environ``, which is how :mod:`eksft_nb.procs` finds and ends them.

The socket is a path in a folder only the job's user can enter, never an abstract name, bound under
a temporary name and renamed into place; the zygote serves only its own user (README, "Security").

Run as ``python -m eksft_nb.runtime.zygote SOCKET_PATH`` with the job's environment.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

from eksft_nb.runtime.warm_shim import at_path, peer

# torch._dynamo: FSDP2 and the optimizers import it on first use (a second of a rank's set-up)
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "torch.distributed", "torch.distributed.fsdp",
           "torch.distributed.checkpoint",
           "nvidia_resiliency_ext.fault_tolerance", "nvidia_resiliency_ext.inprocess",
           "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
           "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
           "eksft_nb.runtime.session", "eksft_nb.runtime.checkpoint.manager", "eksft_nb.runtime.trainer",
           # not the entry modules: runpy runs those afresh
           "eksft_nb.runtime.model", "eksft_nb.runtime.data")
# what the interpreter or torch read once, at start-up or import: a request that differs gets a cold rank
FIXED_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
                  "LD_PRELOAD",
                  "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_CPP_LOG_LEVEL",
                  "PYTHONWARNINGS")
MAX_REQUEST = 4 << 20

_children: dict[int, socket.socket | None] = {}   # rank pid -> its shim's connection (None: gone)
_stopping = [False]
WARM_ENV = "EKSFT_WARM_RANK"   # "1" in a rank forked from a zygote (and in what it starts)


def preload() -> list[str]:
    """Import what ranks import; return the modules that could not be (a rank imports them itself)."""
    import importlib
    import warnings

    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # an NVRx without inprocess, say: that rank pays for it as before
                missing.append(name)
    return missing


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def listen(path: str) -> socket.socket:
    """A socket listening at ``path``: bound under a temporary name beside it (mode 0600), then renamed
    into place, so that a shim that finds the path finds it listening."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.{os.getpid()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            at_path(listener, temporary, listen=True)
        finally:
            os.umask(old)
        listener.listen(128)
        os.replace(temporary, path)
    except BaseException:
        listener.close()
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return listener


def serve(name: str) -> int:
    try:
        listener = listen(name)  # listen first: shims that come while torch imports wait in the backlog
    except OSError as e:
        print(f"eksft zygote {name}: cannot listen ({e.strerror or e}): its ranks start cold",
              file=sys.stderr)
        return 1
    bound = os.stat(name)
    try:
        return _serve(name, listener)
    finally:   # a zygote that ends removes its socket (one killed cannot: its supervisor does)
        _remove(name, (bound.st_dev, bound.st_ino))
        listener.close()


def _remove(name: str, bound: tuple[int, int]) -> None:
    """Remove the socket at ``name`` if it is still the one this zygote bound (not a successor's)."""
    try:
        now = os.stat(name)
        if (now.st_dev, now.st_ino) == bound:
            os.unlink(name)
    except OSError:
        pass


def _serve(name: str, listener: socket.socket) -> int:
    missing = preload()
    # torch's BLAS may park a thread at import; it holds no lock while parked, and a fork copies only this one
    print(f"eksft zygote {name}: ready (pid {os.getpid()}, {threads()} thread(s)"
          + (f", not preloaded: {', '.join(missing)}" if missing else "") + ")", flush=True)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    children = _children
    fixed = {k: os.environ.get(k) for k in FIXED_AT_START}
    while not (_stopping[0] and not children):
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                pid = _start(conn, fixed, sel, listener, (wake_r, wake_w))
                if pid:
                    children[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                else:
                    conn.close()
            elif key.data == "child":
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                _reap(children, sel)
            else:  # the shim's connection closed (or it wrote, which it never does): end its rank
                pid = key.data
                sel.unregister(key.fileobj)
                key.fileobj.close()
                children[pid] = None
                _kill_group(pid)
                _reap(children, sel)
    return 0


def _reap(children: dict, sel: selectors.BaseSelector) -> None:
    while True:
        try:  # an ended child, left a zombie: its pid, and so its group's id, cannot be anyone else's yet
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None:
            return
        pid = ended.si_pid
        # what the rank forked (its checkpoint writer, NVRx's result queue) ends with it, as a cold
        # rank's helpers end in ft_launcher's killpg of the worker: they inherited its sockets, and NVRx
        # 0.6's rank monitor serves the next incarnation only once the old connection has closed.
        # Killed before the reap: once reaped, the pid may be reused, by a process of another group
        _kill_group(pid)
        _, status = os.waitpid(pid, 0)
        conn = children.pop(pid, None)
        if conn is not None:  # None: its shim is gone
            sel.unregister(conn)
            try:
                conn.sendall(b"exit %d\n" % status)
            except OSError:
                pass
            conn.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    if len(data) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("!I", data[:4])
    if size > MAX_REQUEST:
        raise ValueError("request too large")
    body = data[4:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("truncated request")
        body += more
    conn.settimeout(None)
    return json.loads(body), fds


def _start(conn: socket.socket, fixed: dict, sel: selectors.BaseSelector, listener: socket.socket,
           wake: tuple[int, int]) -> int:
    """Fork the rank a shim asks for; its pid, or 0 after telling the shim why not."""
    fds: list[int] = []
    worker = 0
    try:
        worker, uid = peer(conn)
        if uid != os.getuid():
            raise ValueError(f"peer uid {uid} is not ours")
        request, fds = _receive(conn)
        env, argv, cwd = request["env"], request["argv"], request["cwd"]
        if len(fds) != 3 or not isinstance(env, dict) or not isinstance(argv, list) or len(argv) < 1:
            raise ValueError("malformed request")
        differs = [k for k in FIXED_AT_START if env.get(k) != fixed[k]]
        if differs:
            raise ValueError(f"{','.join(differs)} differ from the zygote's")
    except (OSError, ValueError, KeyError, TypeError) as e:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"refused {str(e).replace(' ', '_')}\n".encode())
        except OSError:
            pass
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            code = _become_rank(conn, fds, argv, env, cwd, sel, listener, wake)
        except BaseException:  # nothing of the zygote's loop may run in the child
            code = 1
        os._exit(code)
    for fd in fds:
        os.close(fd)
    print(f"forked rank {pid} for worker {worker}: {' '.join(argv)[:200]}", flush=True)
    try:
        conn.sendall(b"pid %d\n" % pid)
    except OSError:
        _kill_group(pid)
    return pid


def _become_rank(conn: socket.socket, fds: list[int], argv: list[str], env: dict, cwd: str,
                 sel: selectors.BaseSelector, listener: socket.socket, wake: tuple[int, int]) -> int:
    import atexit
    import runpy
    import threading

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    sel.close()
    listener.close()
    conn.close()
    for fd in wake:
        os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[WARM_ENV] = "1"
    code = 0
    interrupted = False
    try:
        if argv[0] == "-m" and len(argv) > 1:
            sys.argv = argv[1:]
            sys.path[0] = cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        interrupted = True
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as python does: die of the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m eksft_nb.runtime.zygote SOCKET_PATH", file=sys.stderr)
        return 2
    zygote = os.getpid()

    def on_term(signum: int, frame: object) -> None:
        if os.getpid() == zygote:  # the ranks get the signal too: their ends, not ours, end their shims
            _stopping[0] = True
            if not _children:
                sys.exit(0)
            return
        signal.signal(signum, signal.SIG_DFL)  # a rank just forked, before it reset this handler
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    return serve(sys.argv[1]) or 0


if __name__ == "__main__":
    sys.exit(main())
