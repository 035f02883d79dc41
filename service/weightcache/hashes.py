"""The BLAKE2b hex digests that name things: cache-key fields and fd-store names.

Content digests of slab bytes are :mod:`weightcache.digest`'s; these hash
small inputs (a safetensors header, ``config.json``, a quantization config's
canonical JSON, a slot's placement) into stable names.

Forbidden imports: torch, socket, weightcache.daemon, weightcache.client, weightcache.memory.
"""

from __future__ import annotations

try:  # hashlib.blake2b is CPython's _blake2.blake2b; importing hashlib also loads OpenSSL's _hashlib (~4 ms)
    from _blake2 import blake2b as _blake2b
except ImportError:  # another interpreter
    from hashlib import blake2b as _blake2b


def blake2b_hex(data: bytes, digest_size: int = 16) -> str:
    """Hex BLAKE2b of ``data`` with a ``digest_size``-byte digest (``2 * digest_size`` hex digits).

    Args:
        data (`bytes`): what to hash.
        digest_size (`int`, *optional*, defaults to 16): digest length in
            bytes (16: the cache key's ``*_blake2b`` fields; 8: fd-store names).

    Example:
        >>> blake2b_hex(b"")
        'cae66941d9efbd404e4d88758ea67670'
    """
    return _blake2b(data, digest_size=digest_size).hexdigest()
