"""Issue 38, P10 on CUDA: a slab fd is checked before the CUDA driver is given it.

Whatever answers at the socket path chooses the fds of an ``attach_reply``. On the cuda backend an engine
imports the slab fd with ``cuMemImportFromShareableHandle``; an fd that cannot be a VMM handle (a FIFO, a
socket, a directory, a regular file or memfd, ``/dev/zero``) is refused before that call with
``manifest_slab_mismatch`` (a ``WeightcacheError``: ``attach(fallback=True)`` loads from disk). Runs without a
GPU (the check is ``fstat``); tests/gpu/test_cuda_backend.py checks that a real exported handle passes it and
that the driver's refusals come out as the same error.
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("cuda.bindings.driver")

from weightcache.errors import ManifestSlabMismatch, WeightcacheError  # noqa: E402
from weightcache.memory.cuda_mapping import check_vmm_fd  # noqa: E402


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    return os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK)


def _socket(tmp_path):
    a, b = socket.socketpair()
    b.close()
    return a.detach()


def _memfd(tmp_path):
    fd = os.memfd_create("slab", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4 << 20)
    return fd


@pytest.mark.parametrize("make,kind", [
    (_fifo, "a FIFO"),
    (_socket, "a socket"),
    (lambda tmp_path: os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), "a directory"),
    (_memfd, "a regular file (a memfd?)"),
    (lambda tmp_path: os.open("/dev/zero", os.O_RDONLY), "the character device 1:5"),
    (lambda tmp_path: os.open("/dev/null", os.O_RDONLY), "the character device 1:3"),
], ids=["fifo", "socket", "directory", "memfd", "dev-zero", "dev-null"])
def test_an_fd_that_cannot_be_a_vmm_handle_is_refused_before_the_driver(tmp_path, make, kind):
    fd = make(tmp_path)
    try:
        with pytest.raises(ManifestSlabMismatch) as e:
            check_vmm_fd(fd, 2 << 20)
    finally:
        os.close(fd)
    assert isinstance(e.value, WeightcacheError) and e.value.code == "manifest_slab_mismatch"
    assert e.value.message.startswith(f"the slab fd received is {kind}, not a CUDA VMM handle"), e.value.message
    assert e.value.details["slab_size_bytes"] == 2 << 20


def test_an_anonymous_file_is_left_to_the_driver():
    fd = os.eventfd(0)  # anon_inode: no file type; only the driver can tell (tests/gpu: it refuses it)
    try:
        check_vmm_fd(fd, 2 << 20)
    finally:
        os.close(fd)
