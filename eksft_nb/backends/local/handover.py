"""Hand a lost node's place to a hot spare at once, in NVRx's legacy rendezvous (0.4.x).

That rendezvous keeps a spare in its redundancy list while the round has ``max_nodes`` participants, and
drops a participant only once its keep-alive has expired: 3 beats of 5 s, fixed in 0.4.1 (no
``--rdzv-conf`` key sets them). Meanwhile the survivors wait (their ranks stuck on the lost peer until
the rank heartbeat timeout): a spare took 18-23 s where a job restart took 7. The supervisor hosts the
rendezvous store and sees a launcher die within a poll, so it edits the rendezvous state itself: the
lost launcher's keep-alive expired, and one spare moved from the redundancy list to the wait list (what
the spare would do itself once the lost node was gone, a second or two of its polling later). Every
node then applies NVRx's own rule on its next sync: the lost node leaves the round, and the survivors'
agents, seeing a node waiting, restart their workers into a new round with the spare.

The state is NVRx's pickled ``_RendezvousState`` under torch's ``torch.rendezvous.<run id>`` key; it is
read with an unpickler that builds only the classes such a state holds and changes nothing it did not
make (anyone who reaches the store can write the state), and written back with the store's
compare-and-set, so a launcher's concurrent write is never lost.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from datetime import datetime
from typing import Any

RDZV_MODULE = "nvidia_resiliency_ext.fault_tolerance._ft_rendezvous"
# what a pickled rendezvous state may name: its own classes, the workers' state enum, timestamps
WORKER_STATE = "nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.agent.server.api"
_ALLOWED = {(RDZV_MODULE, "_RendezvousState"), (RDZV_MODULE, "_NodeDesc"), (WORKER_STATE, "WorkerState"),
            ("datetime", "datetime")}
_NULL_SENTINEL = b"Y2FuaW1hZGFt"   # torch's C10dRendezvousBackend: no state written yet
EXPIRED = datetime(1970, 1, 1)     # a keep-alive older than any expiry window
TRIES = 20


class HandoverError(Exception):
    """The rendezvous state could not be read or written: the spare comes in by NVRx's own expiry."""


def _refusing(what: str) -> Any:
    def op(self: _StateUnpickler) -> None:
        raise pickle.UnpicklingError(f"it uses {what}, which a rendezvous state never does")
    return op


class _StateUnpickler(pickle._Unpickler):  # the Python unpickler: its opcodes can be replaced one by one
    """Names only the classes a rendezvous state holds, and changes nothing but what it made itself
    (the checkpoint loader's rule): NEWOBJ makes fresh instances of the state's two classes; REDUCE only
    looks up a worker state or rebuilds a timestamp from its bytes; BUILD sets the fields of an
    instance made by this load (never a class, a shared object such as an NVRx enum member, or slot
    state); SETITEM(S), ADDITEMS and APPEND(S) fill only dicts, sets and lists, and no two keys of one
    share a hash (a crafted collision makes each insert compare with every key before it)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._fresh = {self.find_class(RDZV_MODULE, n) for n in ("_RendezvousState", "_NodeDesc")}  # NEWOBJ's
        self._worker_state = self.find_class(WORKER_STATE, "WorkerState")
        self._made: dict[int, Any] = {}   # id -> an instance NEWOBJ made here (kept: no id is reused)
        self._hashes: dict[int, tuple[Any, set[int]]] = {}   # id -> (a dict or set, its keys' hashes)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a rendezvous state")
        return super().find_class(module, name)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        if cls not in self._fresh or args != () or kwargs != {}:
            raise pickle.UnpicklingError(f"it makes a {getattr(cls, '__name__', type(cls).__name__)} with "
                                         "arguments, which a rendezvous state never does")
        obj = cls.__new__(cls)
        self._made[id(obj)] = obj
        self.append(obj)

    def load_reduce(self) -> None:
        args, func = self.stack.pop(), self.stack[-1]
        if not (type(args) is tuple and len(args) == 1 and (
                (func is self._worker_state and type(args[0]) in (str, int))
                or (func is datetime and type(args[0]) is bytes and len(args[0]) == 10))):
            raise pickle.UnpicklingError("it calls something other than a worker state's or a timestamp's "
                                         "constructor, which a rendezvous state never does")
        self.stack[-1] = func(*args)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if self._made.get(id(inst)) is not inst or type(state) is not dict:
            raise pickle.UnpicklingError("it sets a class's attributes or slot state, or those of an object "
                                         "it did not make (an NVRx enum member), which a rendezvous state "
                                         "never does")
        if not all(type(k) is str and not k.startswith("__") for k in state):
            raise pickle.UnpicklingError("it sets attributes other than fields, which a rendezvous state "
                                         "never does")
        super().load_build()

    def _insert(self, target: Any, keys: list[Any], kind: type) -> None:
        """Refuse filling ``target`` with ``keys`` unless it is a ``kind`` (all of which are made here:
        no name or call gives the pickle another) and no two of its keys would share a hash."""
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"it fills a {type(target).__name__} as a {kind.__name__}, which "
                                         "a rendezvous state never does")
        if kind is list:
            return
        _, hashes = self._hashes.setdefault(id(target), (target, {hash(k) for k in target}))
        for key in keys:
            h = hash(key)
            if h in hashes:
                raise pickle.UnpicklingError("it holds two keys of one hash (a repeated key, or keys crafted "
                                             "to collide), which a rendezvous state never does")
            hashes.add(h)

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._insert(self.stack[-1], [key], dict)
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._insert(self.stack[-1], items[::2], dict)
        for i in range(0, len(items) - 1, 2):
            self.stack[-1][items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items, made = self.pop_mark(), {}
        self._insert(made, items[::2], dict)
        for i in range(0, len(items) - 1, 2):
            made[items[i]] = items[i + 1]
        self.append(made)

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._insert(self.stack[-1], items, set)
        self.stack[-1].update(items)

    def load_append(self) -> None:
        value = self.stack.pop()
        self._insert(self.stack[-1], [], list)
        self.stack[-1].append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._insert(self.stack[-1], [], list)
        self.stack[-1].extend(items)

    for _op, _fn in ((pickle.NEWOBJ, load_newobj), (pickle.NEWOBJ_EX, load_newobj_ex),
                     (pickle.REDUCE, load_reduce), (pickle.BUILD, load_build), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict),
                     (pickle.ADDITEMS, load_additems), (pickle.APPEND, load_append),
                     (pickle.APPENDS, load_appends), (pickle.INST, _refusing("INST")),
                     (pickle.OBJ, _refusing("OBJ")), (pickle.FROZENSET, _refusing("a frozenset")),
                     (pickle.PERSID, _refusing("a persistent id")),
                     (pickle.BINPERSID, _refusing("a persistent id")),
                     (pickle.EXT1, _refusing("an extension")), (pickle.EXT2, _refusing("an extension")),
                     (pickle.EXT4, _refusing("an extension"))):
        dispatch[_op[0]] = _fn
    del _op, _fn


def _load(raw: bytes) -> Any:
    try:
        return _StateUnpickler(io.BytesIO(base64.b64decode(raw, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError) as e:
        raise HandoverError(f"the rendezvous state is unreadable ({type(e).__name__}: {e})") from e


def expire(store: Any, rdzv_id: str, launcher_pid: int) -> int:
    """Mark the rendezvous nodes of the ft_launcher ``launcher_pid`` (a node descriptor carries its
    launcher's pid) as expired in ``store``'s rendezvous ``rdzv_id`` and, if one was a participant, move a
    spare to the wait list. Returns how many were marked (0: it held no place, or the state is not the
    legacy rendezvous's)."""
    key = "torch.rendezvous." + rdzv_id
    for _ in range(TRIES):
        try:
            if not store.check([key]):   # get() would wait for it
                return 0
            raw = store.get(key)
        except (RuntimeError, ValueError) as e:   # torch's store errors (a timeout is a RuntimeError)
            raise HandoverError(f"the rendezvous store did not answer ({e})") from e
        if raw == _NULL_SENTINEL:
            return 0
        state = _load(raw)
        beats = getattr(state, "last_heartbeats", None)
        if not isinstance(beats, dict):
            return 0
        lost = [n for n in beats if getattr(n, "pid", None) == launcher_pid]
        if not lost:
            return 0
        for node in lost:
            beats[node] = EXPIRED
        spares = getattr(state, "redundancy_list", None)
        waiting = getattr(state, "wait_list", None)
        if (isinstance(spares, set) and isinstance(waiting, set) and spares
                and any(n in getattr(state, "participants", {}) for n in lost)):
            spare = min(spares, key=repr)
            spares.discard(spare)
            waiting.add(spare)
        new = base64.b64encode(pickle.dumps(state)).decode()
        try:
            written = store.compare_set(key, raw.decode(), new)
        except (RuntimeError, ValueError) as e:
            raise HandoverError(f"the rendezvous store did not answer ({e})") from e
        if written == new.encode():
            return len(lost)
    raise HandoverError(f"the rendezvous state kept changing under {TRIES} attempts to write it")
