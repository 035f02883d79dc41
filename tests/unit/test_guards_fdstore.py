"""Guards of the fd store's bookkeeping, in-process (issue 40; survivors of `make mutate` on daemon/fdstore.py).

What the service tells systemd (``FDSTORE=1``/``FDSTOREREMOVE=1`` with
``FDNAME=slab-|host-|manifest-<id>``, read here from a test-owned
``$NOTIFY_SOCKET``), which stored entries it takes back and in which tier,
what it drops and why, and which placements a service whose configuration
does not load serves from the stored manifest files. The restart through a
real service is tests/integration/test_guards_restart.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

import pytest
import torch

from daemon_helpers import loaded_state
from checkpoints import write_checkpoint
from weightcache.daemon.fdstore import FdStore, stored_placements
from weightcache.daemon.state import ServiceState
from weightcache.manifest import pack_file, unpack_file
from weightcache.memory.host import HostBackend, sealed_memfd

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}


@pytest.fixture
def loaded(tmp_path):
    """``(state, backend)``: model ``m``'s one slot loaded into a host slab (the loader's own code)."""
    backend = HostBackend()
    with loaded_state(write_checkpoint(tmp_path / "ck", TENSORS), backend) as st:
        yield st, backend


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    """A datagram socket standing in for systemd's notify socket; ``read()`` -> [(message, fd count)]."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", path)

    def read() -> list[tuple[str, int]]:
        out = []
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 65536, 4)
            except BlockingIOError:
                return out
            for fd in fds:
                os.close(fd)
            out.append((msg.decode(), len(fds)))

    yield read
    sock.close()


def _fresh(st) -> ServiceState:
    return ServiceState(0, "host", st.device, [st.slots[0].placement], service_uid=st.service_uid)


class Recording:
    """A backend named ``name`` that records which adopt it was asked for (and adopts as the host one)."""

    def __init__(self, name: str = "host") -> None:
        self.name, self.calls, self._host = name, [], HostBackend()

    def adopt(self, fd, size_bytes):
        self.calls.append("adopt")
        return self._host.adopt(fd, size_bytes)

    def adopt_host(self, fd, size_bytes):
        self.calls.append("adopt_host")
        return self._host.adopt_host(fd, size_bytes)


def _entries(slot, kind: str = "slab", slab_fd: int | None = None, manifest_fd: int | None = None) -> dict:
    sid = slot.store_id
    return {f"{kind}-{sid}": [os.dup(slot.sealed.fd) if slab_fd is None else slab_fd],
            f"manifest-{sid}": [os.dup(slot.manifest_file.fd) if manifest_fd is None else manifest_fd]}


def _close(adopted: dict) -> None:
    for a in adopted.values():
        a.sealed.close()
        a.manifest_file.close()


# --- put and remove: what systemd is told ----------------------------------------------------------------------


def test_put_stores_the_slab_and_its_manifest_and_a_tier_move_replaces_them(loaded, notify_socket):
    """Invariant: the store holds one slab entry per slot, named by its tier: ``put`` sends the slab
    (``slab-<id>``, or ``host-<id>`` for a host-tier copy) and its manifest file, each with its fd; a second
    put for the same slot first removes both earlier entries; ``remove`` drops the kind this process put."""
    st, backend = loaded
    slot = st.slots[0]
    sid = slot.store_id
    store = FdStore(backend, st.device)
    assert store.enabled
    store.put(slot, slot.sealed, slot.manifest_file)
    assert notify_socket() == [(f"FDSTORE=1\nFDNAME=slab-{sid}", 1), (f"FDSTORE=1\nFDNAME=manifest-{sid}", 1)]
    store.put_host(slot, slot.sealed, slot.manifest_file)
    assert notify_socket() == [(f"FDSTOREREMOVE=1\nFDNAME=slab-{sid}", 0),
                               (f"FDSTOREREMOVE=1\nFDNAME=manifest-{sid}", 0),
                               (f"FDSTORE=1\nFDNAME=host-{sid}", 1), (f"FDSTORE=1\nFDNAME=manifest-{sid}", 1)]
    store.remove(sid)
    assert notify_socket() == [(f"FDSTOREREMOVE=1\nFDNAME=host-{sid}", 0),
                               (f"FDSTOREREMOVE=1\nFDNAME=manifest-{sid}", 0)]
    store.remove(sid)  # nothing recorded any more: the slab kind by default
    assert notify_socket()[0] == (f"FDSTOREREMOVE=1\nFDNAME=slab-{sid}", 0)


def test_put_outside_systemd_sends_nothing(loaded, notify_socket, monkeypatch):
    st, backend = loaded
    monkeypatch.delenv("NOTIFY_SOCKET")
    store = FdStore(backend, st.device)
    assert not store.enabled
    store.put(st.slots[0], st.slots[0].sealed, st.slots[0].manifest_file)
    assert notify_socket() == []


# --- adopt: which tier, which backend call, what is kept -------------------------------------------------------


def test_a_stored_host_tier_copy_is_adopted_into_the_host_tier(loaded, notify_socket):
    """Invariant: ``host-<id>`` with no ``slab-<id>`` is taken back into the host tier (the backend's
    ``adopt_host``), with its manifest, manifest file and served dtypes; removing it later drops the host
    entry. ``slab-<id>`` is taken back onto the GPU (``adopt``)."""
    st, _ = loaded
    slot = st.slots[0]
    for kind, tier, call in (("host", "host", "adopt_host"), ("slab", "gpu", "adopt")):
        backend, fresh = Recording(), _fresh(st)
        store = FdStore(backend, st.device)
        got = store.adopt(_entries(slot, kind), fresh.slots)
        (a,) = got.values()
        assert (a.tier, backend.calls) == (tier, [call])
        assert a.manifest.to_json() == slot.manifest.to_json()
        assert a.manifest_file.size_bytes == slot.manifest_file.size_bytes
        assert a.dtypes_served == frozenset({"auto", "float32"})
        assert a.sealed.size_bytes == slot.sealed.size_bytes
        store.remove(slot.store_id)
        assert notify_socket()[0] == (f"FDSTOREREMOVE=1\nFDNAME={kind}-{slot.store_id}", 0)
        _close(got)


def test_a_cuda_slab_is_a_handle_not_a_memfd_but_its_host_copy_must_be_sealed(loaded, notify_socket):
    """Invariant: on a backend other than ``host`` the GPU slab's fd is a VMM handle (no seals to check),
    while a host-tier copy is a memfd and must carry every seal."""
    st, _ = loaded
    slot = st.slots[0]
    size = os.fstat(slot.sealed.fd).st_size

    def unsealed() -> int:
        fd = os.memfd_create("handle", os.MFD_CLOEXEC)
        os.write(fd, os.pread(slot.sealed.fd, size, 0))
        return fd

    manifest = _manifest_file(slot, backend="cuda")
    backend = Recording("cuda")
    got = FdStore(backend, st.device).adopt(_entries(slot, "slab", unsealed(), manifest), _fresh(st).slots)
    assert backend.calls == ["adopt"] and len(got) == 1
    _close(got)
    backend = Recording("cuda")
    got = FdStore(backend, st.device).adopt(_entries(slot, "host", unsealed(), _manifest_file(slot, backend="cuda")),
                                            _fresh(st).slots)
    assert got == {} and backend.calls == []


def _manifest_file(slot, **fields) -> int:
    """``slot``'s manifest file with some publisher fields replaced."""
    have, manifest = unpack_file(slot.manifest_file.read())
    return sealed_memfd(pack_file(manifest, **{**have, **fields}), "manifest-test")


def test_a_slab_of_another_backend_is_dropped_naming_the_field(loaded, notify_socket, caplog):
    st, backend = loaded
    slot = st.slots[0]
    caplog.set_level(logging.INFO, "weightcache.daemon.fdstore")
    got = FdStore(backend, st.device).adopt(_entries(slot, manifest_fd=_manifest_file(slot, backend="cuda")),
                                            _fresh(st).slots)
    assert got == {}
    assert "reason=key-mismatch fields=device.backend" in caplog.text


@pytest.mark.parametrize("entry, what", [("slab", "slab"), ("manifest", "manifest file")])
def test_a_dropped_entry_names_what_was_wrong(loaded, notify_socket, caplog, entry, what):
    """The journal says which stored fd was refused and why: not a memfd at all, or one without the seals."""
    st, backend = loaded
    slot = st.slots[0]
    caplog.set_level(logging.INFO, "weightcache.daemon.fdstore")
    r, w = os.pipe()
    os.close(w)
    fds = {"slab_fd": r} if entry == "slab" else {"manifest_fd": r}
    assert FdStore(backend, st.device).adopt(_entries(slot, **fds), _fresh(st).slots) == {}
    assert f"reason=stored {what} is not a sealed memfd (" in caplog.text
    caplog.clear()
    plain = os.memfd_create("plain", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(plain, slot.manifest_file.read() if entry == "manifest" else b"\0" * slot.sealed.size_bytes)
    fds = {"slab_fd": plain} if entry == "slab" else {"manifest_fd": plain}
    assert FdStore(backend, st.device).adopt(_entries(slot, **fds), _fresh(st).slots) == {}
    assert f"reason=stored {what} lacks the service's seals (has 0x0, needs 0xf)" in caplog.text


def test_what_adopt_drops_keeps_or_leaves_and_what_systemd_is_told(loaded, notify_socket):
    """Invariant: an entry whose slot is configured but does not match is removed from systemd's store (its
    tier's name); an entry of no configured slot is removed too, unless ``drop_unknown=False`` (a service
    whose configuration did not load), which leaves it there and lists its id in ``left``; an adopted entry
    is not removed. Incomplete entries (no manifest file, two slabs) are not adopted."""
    st, backend = loaded
    slot = st.slots[0]
    sid = slot.store_id
    store = FdStore(backend, st.device)
    got = store.adopt(_entries(slot), _fresh(st).slots)
    assert len(got) == 1 and notify_socket() == []
    _close(got)
    other = dataclasses.replace(slot.placement, model=dataclasses.replace(slot.placement.model, name="other"))
    unknown = ServiceState(0, "host", st.device, [other], service_uid=st.service_uid)
    for kind in ("slab", "host"):
        store = FdStore(backend, st.device)
        assert store.adopt(_entries(slot, kind), unknown.slots, drop_unknown=False) == {}
        assert store.left == {sid} and notify_socket() == []
        store = FdStore(backend, st.device)
        assert store.adopt(_entries(slot, kind), unknown.slots) == {}
        assert store.left == set() and notify_socket() == [(f"FDSTOREREMOVE=1\nFDNAME={kind}-{sid}", 0),
                                                             (f"FDSTOREREMOVE=1\nFDNAME=manifest-{sid}", 0)]
    no_manifest = {f"slab-{sid}": [os.dup(slot.sealed.fd)]}
    assert FdStore(backend, st.device).adopt(no_manifest, _fresh(st).slots) == {}
    two = _entries(slot)
    two[f"slab-{sid}"].append(os.dup(slot.sealed.fd))
    assert FdStore(backend, st.device).adopt(two, _fresh(st).slots) == {}
    assert FdStore(backend, st.device).adopt(_entries(slot, manifest_fd=_manifest_file(slot, dtypes_served=None)),
                                             _fresh(st).slots) != {}


# --- stored_placements: what a service with a broken configuration serves --------------------------------------


def test_stored_placements_reads_the_placements_of_this_gpu_and_one_backend(loaded):
    """Invariant: the placements recorded in the stored manifest files, for this GPU only, all of the first
    backend seen; entries that are not manifest files, hold other than one fd, carry no placement or do not
    parse are skipped (they stay in the store)."""
    st, _ = loaded
    slot = st.slots[0]
    p = slot.placement
    on1 = dataclasses.replace(p, gpu=1)
    other = dataclasses.replace(p, model=dataclasses.replace(p.model, name="other"))
    garbage = sealed_memfd(b"not a manifest file", "garbage")
    stored = {
        "manifest-a": [_manifest_file(slot, placement=p.to_json())],
        "manifest-b": [_manifest_file(slot, placement=on1.to_json())],  # another GPU
        "manifest-c": [_manifest_file(slot, placement=other.to_json(), backend="cuda")],  # another backend
        "manifest-d": [_manifest_file(slot, placement=None)],  # an older release: no placement
        "manifest-e": [garbage],
        "manifest-f": [],
        "slab-a": [os.dup(slot.sealed.fd)],
    }
    try:
        assert stored_placements(stored, 0) == ([p], "host")
        assert stored_placements(stored, 1) == ([on1], "host")
        assert stored_placements({"manifest-c": stored["manifest-c"]}, 0) == ([other], "cuda")
        assert stored_placements({}, 0) == ([], None)
    finally:
        for fds in stored.values():
            for fd in fds:
                os.close(fd)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@pytest.mark.parametrize("alone", ["slab", "host", "manifest"])
def test_an_entry_without_its_pair_is_closed_and_removed(loaded, notify_socket, caplog, alone):
    """Invariant: every stored entry is accounted for, even alone (a slab without its manifest file, or the
    reverse): it is not adopted, this process closes its fd, and systemd is told to drop the slot's entries;
    the journal does not call a configured slot 'no longer configured'."""
    st, backend = loaded
    slot = st.slots[0]
    sid = slot.store_id
    caplog.set_level(logging.INFO, "weightcache.daemon.fdstore")
    fd = os.dup(slot.manifest_file.fd if alone == "manifest" else slot.sealed.fd)
    assert FdStore(backend, st.device).adopt({f"{alone}-{sid}": [fd]}, _fresh(st).slots) == {}
    assert _closed(fd)
    kind = "host" if alone == "host" else "slab"
    assert notify_socket() == [(f"FDSTOREREMOVE=1\nFDNAME={kind}-{sid}", 0),
                               (f"FDSTOREREMOVE=1\nFDNAME=manifest-{sid}", 0)]
    assert "no-longer-configured" not in caplog.text


def test_the_fds_of_a_dropped_entry_are_closed_and_an_unknown_slot_is_logged(loaded, notify_socket, caplog):
    st, backend = loaded
    slot = st.slots[0]
    caplog.set_level(logging.INFO, "weightcache.daemon.fdstore")
    entries = _entries(slot, manifest_fd=_manifest_file(slot, backend="cuda"))  # a key mismatch
    assert FdStore(backend, st.device).adopt(entries, _fresh(st).slots) == {}
    assert all(_closed(fd) for fds in entries.values() for fd in fds)
    other = dataclasses.replace(slot.placement, model=dataclasses.replace(slot.placement.model, name="other"))
    unknown = ServiceState(0, "host", st.device, [other], service_uid=st.service_uid)
    entries = _entries(slot)
    assert FdStore(backend, st.device).adopt(entries, unknown.slots) == {}
    assert all(_closed(fd) for fds in entries.values() for fd in fds)
    assert f"fd store slab dropped id={slot.store_id} reason=no-longer-configured" in caplog.text


def test_stored_placements_skips_what_it_cannot_use_and_reads_on(loaded):
    """Entries that are skipped (no fd, unreadable, no placement) do not end the scan: every usable manifest
    file after them counts, each of the same backend."""
    st, _ = loaded
    slot = st.slots[0]
    p = slot.placement
    second = dataclasses.replace(p, model=dataclasses.replace(p.model, name="second"))
    stored = {
        "manifest-0": [],
        "manifest-1": [sealed_memfd(b"not a manifest file", "garbage")],
        "manifest-2": [_manifest_file(slot, placement=None)],
        "manifest-3": [_manifest_file(slot, placement=p.to_json())],
        "manifest-4": [_manifest_file(slot, placement=second.to_json())],
    }
    try:
        assert stored_placements(stored, 0) == ([p, second], "host")
    finally:
        for fds in stored.values():
            for fd in fds:
                os.close(fd)
