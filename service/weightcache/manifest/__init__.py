"""Slab manifests: the tensor records inside a slab, the views built from them, and the manifest file.

The face of the package. Its rooms:

- :mod:`._manifest`: :class:`Manifest` and :class:`TensorRecord`, their packed wire form, and the views;
- :mod:`._file`: the manifest file (a sealed memfd beside each slab, also kept in systemd's fd store).

Forbidden imports: torch at module level, socket, selectors, weightcache.config, weightcache.daemon,
weightcache.client.
"""

from __future__ import annotations

from ._file import FILE_FORMAT, MAX_MANIFEST_BYTES, ManifestFile, pack_file, read_file, unpack_file
from ._manifest import (ALIGNMENT_BYTES, DTYPES, PACKED_FORMAT, LayoutMap, Manifest, PackedTensors, TensorRecord,
                        align, build_views, contiguous_stride, itemsize, torch_dtype, warm_up_views)

__all__ = ["ALIGNMENT_BYTES", "DTYPES", "FILE_FORMAT", "LayoutMap", "MAX_MANIFEST_BYTES", "Manifest", "ManifestFile",
           "PACKED_FORMAT", "PackedTensors", "TensorRecord", "align", "build_views", "contiguous_stride", "itemsize",
           "pack_file", "read_file", "torch_dtype", "unpack_file", "warm_up_views"]
