"""Guards of a slab's identity and integrity, in-process (issue 40).

Each test names the invariant it guards; each was checked to fail with the bug
it exists for put back by hand (docs/mutation.md lists them):

- a cache-key field present in one key and missing in the other is a
  mismatch, both in :func:`weightcache.identity.diff_keys` and where it decides
  (the fd store's adoption of a kept slab, the engine's check of a service's key);
- every required seal of a stored memfd is checked, not any one of them;
- ``verify`` names the tensor whose resident bytes changed.

A real two-tensor checkpoint is loaded through the loader's own code into a
host slab, as in tests/unit/test_daemon_handlers.py.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os

import pytest
import torch

from daemon_helpers import loaded_state
from checkpoints import write_checkpoint
from weightcache import identity, protocol
from weightcache.daemon import handlers
from weightcache.daemon.fdstore import REQUIRED_SEALS, FdStore
from weightcache.daemon.effects import Context
from weightcache.daemon.state import Peer, ServiceState
from weightcache.manifest import pack_file, unpack_file
from weightcache.memory.host import (F_ADD_SEALS, F_GET_SEALS, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_WRITE,
                                     HostBackend, HostWritableSlab, sealed_memfd)

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}


@pytest.fixture
def loaded(tmp_path):
    """A service state whose one slot (model ``m``) is loaded into a host slab; ``(ctx, state, backend)``."""
    backend = HostBackend()
    with loaded_state(write_checkpoint(tmp_path / "ck", TENSORS), backend) as st:
        yield Context(st, lambda: (111, 222), monotonic=lambda: 100.0, wall=lambda: 1.7e9, pid=4242), st, backend


# --- diff_keys: a field in one key only is a difference ------------------------------------------------------


@pytest.mark.parametrize("expected, actual, want", [
    ({"a": 1, "b": 2}, {"a": 1}, ["b"]),  # a field this release has and the kept key lacks
    ({"a": 1}, {"a": 1, "b": 2}, ["b"]),  # a field the kept key has and this release dropped
    ({"d": {"x": 1, "y": 2}}, {"d": {"x": 1}}, ["d.y"]),  # nested (device, checkpoint.files...)
    ({"d": {"x": 1}}, {"d": {"x": 1, "z": None}}, ["d.z"]),  # even a None field is a field
    ({"a": 1, "b": 2}, {"a": 3, "c": 2}, ["a", "b", "c"]),
    ({"a": {"x": 1}}, {"a": 1}, ["a"]),
    ({"a": 1}, {"a": 1}, []),
])
def test_diff_keys_lists_fields_present_in_only_one_key(expected, actual, want):
    """Invariant: two cache keys match only when they have the same fields with the same values; a field one
    of them lacks is listed (a key field added in one release is never silently equal)."""
    assert identity.diff_keys(expected, actual) == want


def _manifest_file_with_key(slot, change) -> int:
    """A sealed manifest file equal to ``slot``'s except that its cache key went through ``change(dict)``."""
    fields, manifest = unpack_file(slot.manifest_file.read())
    key = dict(manifest.key)
    change(key)
    return sealed_memfd(pack_file(dataclasses.replace(manifest, key=key), **fields), "manifest-test")


def _fresh(st):
    """A service state after a restart: the same placement, nothing loaded."""
    return ServiceState(0, "host", st.device, [st.slots[0].placement], service_uid=st.service_uid)


@pytest.mark.parametrize("change", [
    pytest.param(lambda k: k.pop("kernel"), id="kept-key-lacks-a-field"),
    pytest.param(lambda k: k.update(added_in_a_later_release="x"), id="kept-key-has-an-extra-field"),
    pytest.param(lambda k: k["device"].pop("compute_capability"), id="kept-key-lacks-a-device-field"),
    pytest.param(lambda k: k["checkpoint"].pop("quant_config_blake2b"), id="kept-key-lacks-a-checkpoint-field"),
])
def test_a_kept_slab_whose_key_has_other_fields_is_not_adopted(loaded, change):
    """Invariant: the fd store adopts a kept slab only when its manifest's key has exactly the fields (and
    values) of the key computed now: a manifest from a release with one field more or less is dropped."""
    ctx, st, backend = loaded
    slot = st.slots[0]
    store, fresh = FdStore(backend, st.device), _fresh(st)
    sid = fresh.slots[0].store_id
    unchanged = store.adopt(
        {f"slab-{sid}": [os.dup(slot.sealed.fd)], f"manifest-{sid}": [os.dup(slot.manifest_file.fd)]}, fresh.slots)
    assert list(unchanged) == fresh.slots  # the same slab with its own manifest is adopted...
    unchanged[fresh.slots[0]].sealed.close()
    unchanged[fresh.slots[0]].manifest_file.close()
    fresh = _fresh(st)
    got = store.adopt(
        {f"slab-{sid}": [os.dup(slot.sealed.fd)], f"manifest-{sid}": [_manifest_file_with_key(slot, change)]},
        fresh.slots)
    assert got == {}  # ... with one key field more or less it is dropped


@pytest.mark.parametrize("change", [
    pytest.param(lambda k: k.pop("pipeline_version"), id="service-key-lacks-a-field"),
    pytest.param(lambda k: k.update(added_in_a_later_release="x"), id="service-key-has-an-extra-field"),
])
def test_the_engines_check_of_a_service_key_with_other_fields_is_a_mismatch(loaded, change):
    """Invariant: an engine (the client's :func:`identity.check_key`) accepts a service's slab only when the
    service's key has exactly the fields of the engine's own view."""
    from weightcache.checkpoint import Checkpoint

    ctx, st, backend = loaded
    slot = st.slots[0]
    ck = Checkpoint(slot.placement.model.path, validate=False)
    fields = identity.key_fields(slot.placement, ck, st.device)
    key = dict(slot.manifest.key)
    assert identity.check_key(fields, ck, key) == []
    change(key)
    assert identity.check_key(fields, ck, key) != []


# --- the seals of a stored memfd: all four, not any one -------------------------------------------------------

_SEALS = (F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE)


def _memfd_with_seals(data: bytes, seals: int) -> int:
    """A memfd holding ``data`` with exactly ``seals`` (F_SEAL_SEAL last: it forbids adding the others)."""
    fd = os.memfd_create("seals-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals & ~F_SEAL_SEAL:
        fcntl.fcntl(fd, F_ADD_SEALS, seals & ~F_SEAL_SEAL)
    if seals & F_SEAL_SEAL:
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL)
    assert fcntl.fcntl(fd, F_GET_SEALS) & REQUIRED_SEALS == seals
    return fd


_SUBSETS = [sum(c) for n in range(len(_SEALS)) for c in itertools.combinations(_SEALS, n)]


@pytest.mark.parametrize("entry", ["slab", "manifest"])
@pytest.mark.parametrize("seals", _SUBSETS, ids=lambda s: f"seals{s:#x}")
def test_a_stored_memfd_lacking_any_required_seal_is_not_adopted(loaded, entry, seals):
    """Invariant: a stored slab or manifest file is adopted only with every one of F_SEAL_SEAL, SHRINK, GROW
    and WRITE; each proper subset (one seal, two, three, none) is dropped, whatever the bytes."""
    ctx, st, backend = loaded
    slot = st.slots[0]
    store, fresh = FdStore(backend, st.device), _fresh(st)
    sid = fresh.slots[0].store_id
    slab_fd, man_fd = os.dup(slot.sealed.fd), os.dup(slot.manifest_file.fd)
    if entry == "slab":
        os.close(slab_fd)
        slab_fd = _memfd_with_seals(os.pread(slot.sealed.fd, os.fstat(slot.sealed.fd).st_size, 0), seals)
    else:
        os.close(man_fd)
        man_fd = _memfd_with_seals(slot.manifest_file.read(), seals)
    assert store.adopt({f"slab-{sid}": [slab_fd], f"manifest-{sid}": [man_fd]}, fresh.slots) == {}


# --- verify names a changed tensor -----------------------------------------------------------------------------


def _flipped_copy(sealed, offset: int):
    """A sealed host slab with ``sealed``'s bytes but one bit of byte ``offset`` flipped."""
    w = HostWritableSlab(sealed.size_bytes, "flipped")
    w.buffer[:] = os.pread(sealed.fd, sealed.size_bytes, 0)
    w.buffer[offset] ^= 0x01
    return w.seal()


@pytest.mark.parametrize("tensor", ["w", "b"])
def test_verify_names_the_tensor_whose_resident_bytes_changed(loaded, tensor):
    """Invariant: ``verify`` recomputes every tensor's digest and names the tensor whose byte changed (and only
    it); an unchanged slab reports none."""
    ctx, st, backend = loaded
    slot = st.slots[0]
    peer = Peer(1, 0, 0)

    def verify():
        out = handlers.handle(ctx, peer, protocol.Verify("m"))
        (eff,) = out.effects
        (reply,) = handlers.verify_reply(peer, eff).replies
        return [(r.state, r.tensors, r.mismatched) for r in reply.msg.typed()]

    assert verify() == [("ready", 2, [])]
    (rec,) = [r for r in slot.manifest.tensors if r.name == tensor]
    flipped = _flipped_copy(slot.sealed, rec.offset_bytes + rec.size_bytes - 1)
    slot.sealed.close()
    slot.sealed = flipped
    assert verify() == [("ready", 2, [tensor])]
