"""Guards of the fd store's adoption, through a restart as systemd does it (issue 40).

A service stores its slab and manifest file in a stand-in fd store
(:class:`~service_harness.FdStoreStandIn`); the test changes one thing while
the service is stopped and starts it again with the stored fds, as systemd
does after a restart. Each test names the invariant it guards:

- a slab is adopted only while its checkpoint is the one it was filled from
  (the checkpoint identity is part of the key the adoption compares);
- a stored memfd is adopted only with *every* seal the service sets (a memfd
  made without ``MFD_ALLOW_SEALING`` reports ``F_SEAL_SEAL`` alone and stays
  writable).

Either way the slab is dropped and loaded again from disk: ``adopted`` is
false, and an engine maps the bytes of the checkpoint as it is now.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import FdStoreStandIn, make_config, poll_until, to_toml  # noqa: E402
from checkpoints import compare_bytes, read_checkpoint, write_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402
from weightcache.errors import DaemonUnavailable  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _ckpt(dest: Path, seed: int) -> Path:
    """Two float32 tensors whose values differ per seed and whose names, shapes and header do not."""
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint(dest, {"a.weight": torch.randn(4, 8, generator=g), "b.bias": torch.randn(8, generator=g)})


def _status(listen: Path) -> dict:
    s = Session(str(listen), timeout=10)
    try:
        return s.request(protocol.Status()).status
    finally:
        s.close()


def _restart_after(store: FdStoreStandIn, tmp_path: Path, ck: Path, change) -> tuple[dict, str]:
    """Serves ``ck`` with the stand-in fd ``store``, stops the service (SIGTERM), calls ``change(store)`` and
    starts it again with the stored fds; returns the restarted service's settled slab status and its log."""
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"m": ck})))
    first = store.serve(cfg, listen, log)
    stored = store.collect(2, log=log.read_text)
    assert sorted(n.split("-", 1)[0] for n in stored) == ["manifest", "slab"]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0, log.read_text()
    change(store)
    second = store.serve(cfg, listen, log)

    def settled() -> dict | None:
        assert second.poll() is None, log.read_text()
        try:
            st = _status(listen) if listen.exists() else None
        except DaemonUnavailable:
            return None
        if st and all(s["state"] not in ("pending", "loading") for s in st["slabs"]):
            return st
        return None

    st = poll_until(settled, "the restarted service to settle", 90, detail=log.read_text)
    (slab,) = st["slabs"]
    return slab, log.read_text()


def _served_bytes_equal_disk(tmp_path: Path, ck: Path) -> None:
    with attach(str(ck), socket_dir=str(tmp_path), fallback=False, timeout=60) as w:
        assert w.source == "daemon"
        compare_bytes(w.tensors, read_checkpoint(ck))


def test_a_checkpoint_replaced_while_stopped_is_not_adopted(tmp_path):
    """Invariant: the adoption's key includes the checkpoint identity. The checkpoint is rewritten with other
    values while the service is stopped (same names, shapes, dtypes, config: every other key field equal);
    the kept slab holds the old values, so it must be dropped and the new bytes loaded and served."""
    ck = _ckpt(tmp_path / "ck", 1)

    def replace_checkpoint(store) -> None:
        _ckpt(tmp_path / "ck", 2)

    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        slab, log = _restart_after(store, tmp_path, ck, replace_checkpoint)
        assert (slab["state"], slab["adopted"]) == ("ready", False), log
        assert "reason=key-mismatch fields=checkpoint.files.model.safetensors." in log, log
        _served_bytes_equal_disk(tmp_path, ck)


def _writable_copy_without_sealing(fd: int) -> int:
    """A memfd made without ``MFD_ALLOW_SEALING`` holding ``fd``'s bytes: it reports ``F_SEAL_SEAL`` alone and
    can still be written by whoever holds it."""
    import fcntl

    from weightcache.memory.host import F_GET_SEALS, F_SEAL_SEAL

    size = os.fstat(fd).st_size
    copy = os.memfd_create("not-sealable", os.MFD_CLOEXEC)
    os.write(copy, os.pread(fd, size, 0))
    assert fcntl.fcntl(copy, F_GET_SEALS) == F_SEAL_SEAL  # one of the four the service sets
    os.pwrite(copy, os.pread(copy, 1, 0), 0)  # and writable
    return copy


@pytest.mark.parametrize("entry", ["slab", "manifest"])
def test_a_stored_memfd_with_one_seal_of_four_is_not_adopted(tmp_path, entry):
    """Invariant: a stored memfd is adopted only with all of F_SEAL_SEAL|SHRINK|GROW|WRITE. The stored slab (or
    its manifest file) is swapped for a copy of the same bytes in a memfd made without MFD_ALLOW_SEALING,
    which reports F_SEAL_SEAL and nothing else and stays writable: it must be dropped, not served."""
    ck = _ckpt(tmp_path / "ck", 1)

    def swap(store) -> None:
        (name,) = [n for n in store.fds if n.startswith(entry + "-")]
        old = store.fds[name]
        store.fds[name] = _writable_copy_without_sealing(old)
        os.close(old)

    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        slab, log = _restart_after(store, tmp_path, ck, swap)
        assert (slab["state"], slab["adopted"]) == ("ready", False), log
        assert "lacks the service's seals (has 0x1, needs 0xf)" in log, log
        _served_bytes_equal_disk(tmp_path, ck)
