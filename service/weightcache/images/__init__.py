"""Processed images: a slab written to disk once it is ready, and read back instead of the checkpoint.

The face of the package (issue 36; docs/design.md, "Processed images"). Its rooms, lowest first:

- :mod:`._format`: the image file (a safetensors file: the slab's bytes as one ``U8`` tensor, the
  manifest, the cache key and the digest in ``__metadata__``);
- :mod:`._stats`: the counters the metrics read;
- :mod:`._store`: the directory (names, access, finding, checking and reading an image, moving a bad
  one aside, listing, the byte limit);
- :mod:`._writer`: the writer thread (room, rate cap, temporary name, ``fsync``, ``rename``).

Forbidden imports: torch, socket, selectors, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from ._format import (
           DATA_ALIGN,
           FORMAT,
           REJECTED_SUFFIX,
           SUFFIX,
           TENSOR_NAME,
           ImageFormatError,
           ImageHeader,
           build_header,
           read_header,
)
from ._stats import ImageStats
from ._store import (
           DEFAULT_IMAGE_DIR,
           TMP_MARK,
           Image,
           ImageEntry,
           ImageStore,
           Rejected,
           comparable_key,
           image_name,
)
from ._writer import ImageWriter, WriteJob

__all__ = ["DATA_ALIGN", "DEFAULT_IMAGE_DIR", "FORMAT", "REJECTED_SUFFIX", "SUFFIX", "TENSOR_NAME", "TMP_MARK", "Image",
           "ImageEntry", "ImageFormatError", "ImageHeader", "ImageStats", "ImageStore", "ImageWriter", "Rejected",
           "WriteJob", "build_header", "comparable_key", "image_name", "read_header"]
