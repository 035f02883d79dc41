"""Samples of the checkpoint's tensor data: what tells two checkpoints with the same headers apart.

Headers fix names, dtypes, shapes and byte ranges, not values: two fine-tunes of one base model have
headers equal byte for byte (the tests' two Llamas of different seeds do), so the portable identity
(:mod:`._keys`) alone would take one for the other. The receiver therefore picks ``count`` random ranges of
its own checkpoint's tensor data (:data:`SAMPLE_BYTES` each, positions from ``secrets``, so a peer cannot
know them in advance), sends them with its request, and the source answers with the same ranges read
from **its** checkpoint (after checking, by ``stat()``, that its files are still those its slab was made
from). Equal samples, equal headers and sizes: the same checkpoint, with the odds that a checkpoint differing
in a fraction ``f`` of its bytes passes ``(1 - f) ** count``. ``[service] seed_samples = 0`` trusts the
headers alone; then not one byte of tensor data is read here.

Where both ends hold the checkpoint as a Hugging Face hub snapshot, no sample is needed: each data file is a
link to ``../../blobs/<sha256 of its content>`` (:func:`hub_blobs`), so equal blob names are equal contents
(as the hub verified them at download). Then the samples are neither read nor compared.

Forbidden imports: torch, weightcache.daemon, nixl.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any

from ..checkpoint import Checkpoint

#: Bytes of one sample.
SAMPLE_BYTES = 4096
#: Most samples a source reads for one request, and the most bytes of one.
MAX_SAMPLES = 64


_SHA256 = re.compile(r"[0-9a-f]{64}")


def hub_blobs(ck: Checkpoint) -> dict[str, str] | None:
    """``{file: sha256}`` when every safetensors file of ``ck`` is a hub snapshot's link to
    ``blobs/<sha256>`` (the content's hash, a Git LFS object id); None otherwise (a plain copy). Reads no data."""
    out = {}
    for fname in ck.files:
        real = str(ck.file_path(fname))
        parent, name = os.path.split(real)
        if os.path.basename(parent) != "blobs" or not _SHA256.fullmatch(name):
            return None
        out[fname] = name
    return out


def choose(ck: Checkpoint, count: int) -> list[list[Any]]:
    """``count`` random ``[file, offset, length]`` ranges of ``ck``'s tensor data (past each header),
    files weighted by their data bytes; ``[]`` for ``count`` 0 or a checkpoint without data."""
    if count <= 0:
        return []
    return _choose(ck, [(fname, 8 + len(raw)) for fname, raw in ck.raw_headers.items()], count)


def _choose(ck: Checkpoint, spans: list[tuple[str, int]], count: int) -> list[list[Any]]:
    rng = secrets.SystemRandom()
    sized = []
    for fname, start in spans:
        fd = ck.open_member(fname)
        try:
            end = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if end > start:
            sized.append((fname, start, end))
    total = sum(e - s for _, s, e in sized)
    out: list[list[Any]] = []
    if not total:
        return out
    for _ in range(count):
        at = rng.randrange(total)
        for fname, s, e in sized:
            if at < e - s:
                off = s + at
                out.append([fname, off, min(SAMPLE_BYTES, e - off)])
                break
            at -= e - s
    return out


def read(ck: Checkpoint, samples: list[list[Any]]) -> list[bytes]:
    """The bytes of each ``[file, offset, length]`` of ``ck`` (a short read gives fewer bytes).

    Raises:
        ValueError: a sample names a file not in ``ck``, or asks for too much (:data:`MAX_SAMPLES`,
            :data:`SAMPLE_BYTES`). The errors of :meth:`Checkpoint.open_member`.
    """
    if len(samples) > MAX_SAMPLES:
        raise ValueError(f"{len(samples)} samples, at most {MAX_SAMPLES}")
    files = set(ck.files)
    out = []
    for fname, off, n in samples:
        if fname not in files or not isinstance(off, int) or not isinstance(n, int) or off < 0 \
                or not 0 < n <= SAMPLE_BYTES:
            raise ValueError(f"sample {fname!r} {off!r} {n!r} is not a range of this checkpoint's files")
        fd = ck.open_member(fname)
        try:
            out.append(os.pread(fd, n, off))
        finally:
            os.close(fd)
    return out


def source_samples(path: str, identity: dict[str, Any], samples: list[list[Any]],
                   blobs: dict[str, str] | None = None) -> tuple[list[bytes], dict[str, str] | None] | None:
    """A source's answer: its checkpoint's hub blob names (:func:`hub_blobs`), and ``samples`` read from its
    checkpoint at ``path`` unless the receiver's ``blobs`` equal its own (the contents are then known equal,
    nothing is read); None when the files are no longer those of ``identity`` (the slab's key: ``stat()``
    only), so the slab is not offered.

    Raises:
        ValueError: see :func:`read`. The checkpoint's errors (gone, unreadable).
    """
    ck = Checkpoint(path, validate=False)
    try:
        if ck.identity_diff(identity):
            return None
        mine = hub_blobs(ck)
        if mine is not None and mine == blobs:
            return [], mine
        return read(ck, samples), mine
    finally:
        ck.close()
