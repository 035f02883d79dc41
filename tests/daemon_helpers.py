"""Helpers the in-process daemon tests share (tests/unit/test_daemon_*.py): a settable clock and the
teardown that closes what loads left in a service state."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class Clock:
    """A clock that stands still until a test moves ``t`` (seconds); pass it where a service reads
    ``time.monotonic``."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def close_slabs(state: Any) -> None:
    """Closes the sealed slab and manifest file of every slot of ``state`` (a ServiceState) that holds one."""
    for s in state.slots:
        if s.sealed is not None:
            s.sealed.close()
            s.manifest_file.close()


@contextlib.contextmanager
def loaded_state(ck: Any, backend: Any, model: str = "m") -> Iterator[Any]:
    """A ServiceState (GPU 0, host backend ``backend``) with one slot, model ``model`` of checkpoint ``ck`` at
    TP 1, loaded into a slab through the loader's own code run in this thread; its slabs closed on exit."""
    import os

    from weightcache.config import ModelConfig, Placement
    from weightcache.daemon import load_results, loads
    from weightcache.daemon.state import ServiceState
    from weightcache.reader import LoaderOptions

    st = ServiceState(0, "host", backend.device_info(), [Placement(ModelConfig(model, str(ck)), 1, 0, 0)],
                      service_uid=os.getuid() + 1)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        loader = loads.Loader(loads.LoadSettings(backend, st.device, 60.0, LoaderOptions(threads=1), "test.toml"), w)
        final = loader._supervise(st.slots[0])  # the loader thread's body, run here
        for result in loader.results() + [final]:
            load_results.apply(st, result)
        assert st.slots[0].sealed is not None, st.slots[0].error
        yield st
    finally:
        close_slabs(st)
        os.close(r)
        os.close(w)


def fd_serving_transport(path: str, limits: Any = None, backlog: int = 4) -> tuple[Any, Any, tuple[int, int]]:
    """A started :class:`~weightcache.daemon.transport.Transport` listening at ``path`` (no trusted uid, a clock
    at 0) that answers ``hello``, and every other request with an ``attach_reply`` carrying the two fds of one
    pipe: what the caps on fds in flight and connections count. ``limits``: its ``Limits`` (the defaults when
    None).

    Returns:
        ``(transport, listener, (r, w))``: the caller closes the transport's clients, the listener and the pipe.
    """
    import os
    import socket

    from weightcache import protocol
    from weightcache.daemon.limits import Limits
    from weightcache.daemon.transport import Callbacks, Transport

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(backlog)
    r, w = os.pipe()

    def on_message(c: Any, msg: Any, fds: tuple = ()) -> None:
        if isinstance(msg, protocol.Hello):
            tr.send(c, protocol.HelloReply(protocol.PROTOCOL_VERSION, 0, "", "host", []))
        else:
            tr.send(c, protocol.AttachReply(1, "/x", "host", 0), (r, w))

    tr = Transport(listener, Callbacks(on_message, lambda c: None, lambda c: None),
                   limits if limits is not None else Limits.defaults(), Clock(0.0), trusted_uids=frozenset())
    tr.start()
    return tr, listener, (r, w)
