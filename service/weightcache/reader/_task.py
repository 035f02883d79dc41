"""One read of the reader: a :class:`ReadTask`, the lowest room of :mod:`weightcache.reader`.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``O_DIRECT`` alignment of file offsets, lengths and buffers, bytes.
DIRECT_ALIGN = 4096


@dataclass(frozen=True)
class ReadTask:
    """``length`` bytes at ``file_offset`` of ``path`` go to ``slab_offset``; ``rows`` times when strided.

    A strided task places ``rows`` rows of ``length`` bytes: row ``i`` is read
    at ``file_offset + i * src_pitch`` and written at ``slab_offset + i *
    dst_pitch`` (a row-parallel shard: ``src_pitch`` is the checkpoint row,
    ``length`` the rank's part of it; an FP8 weight whose rows are padded:
    ``dst_pitch`` is the padded row). ``rows == 1`` is one contiguous range.
    """

    path: str
    file_offset: int
    length: int
    slab_offset: int
    tensor: str
    rows: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the task writes into the slab."""
        return self.length * self.rows

    @property
    def file_span(self) -> int:
        """Bytes from the first row's start to the last row's end in the file."""
        return self.length if self.rows == 1 else (self.rows - 1) * self.src_pitch + self.length
