"""The fleet's shared secret and the HMAC of every control-channel frame.

The secret file (``[service] seed_secret_file``, ``/etc/weightcache/seed.secret`` by default) holds one
secret per line (blank lines and ``#`` comments ignored); each secret is at least 32 characters (e.g.
``openssl rand -hex 32``). The **first** line signs what this node sends; **every** line is accepted on
what it receives. Rotation: (1) append the new secret as a second line on every node, (2) move it to the
first line on every node, (3) remove the old line: at each step any two nodes share a secret that one
signs with and the other accepts, so no transfer is refused during the rotation window.

The file must be a regular file owned by root or the service user, not readable or writable by group or
others (mode 0600 or 0400): anything else is refused with :class:`SecretError`, naming the file.

Forbidden imports: socket, torch, weightcache.daemon, nixl.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

#: Where the secret lives unless ``[service] seed_secret_file`` says otherwise.
DEFAULT_SECRET_FILE = "/etc/weightcache/seed.secret"
#: Shortest secret accepted (characters of one line).
MIN_SECRET_CHARS = 32


class SecretError(Exception):
    """The secret file is missing, unreadable, too open, or holds no usable secret (the message names it)."""


@dataclass(frozen=True)
class Secret:
    """The secrets of one node: ``keys[0]`` signs, every key verifies.

    Attributes:
        keys (`tuple[bytes, ...]`): one or more secrets, the signing one first.
        path (`str`): the file they were read from (for messages).
    """

    keys: tuple[bytes, ...]
    path: str = ""

    def sign(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 (32 bytes) of ``parts`` (each length-prefixed, so no two splits collide) with ``keys[0]``."""
        return _mac(self.keys[0], parts)

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        """Whether ``mac`` is the HMAC of ``parts`` under any of :attr:`keys` (constant time per key)."""
        ok = False
        for k in self.keys:
            ok |= hmac.compare_digest(mac, _mac(k, parts))
        return ok


def _mac(key: bytes, parts: tuple[bytes, ...]) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def load_secret(path: str = DEFAULT_SECRET_FILE, allowed_owners: frozenset[int] | None = None) -> Secret:
    """Reads the secret file.

    Args:
        path (`str`): the file.
        allowed_owners (`frozenset[int]`, *optional*): uids that may own it (default: root and this process's uid).

    Returns:
        `Secret`.

    Raises:
        SecretError: missing, not a regular file, owned by another user, readable or writable by group or
            others, or without a line of at least :data:`MIN_SECRET_CHARS` characters.
    """
    owners = allowed_owners if allowed_owners is not None else frozenset({0, os.getuid()})
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise SecretError(f"seeding secret {path}: cannot open it: {e.strerror}; create it with "
                          f"`install -m 0600 /dev/null {path} && openssl rand -hex 32 > {path}` on every node of "
                          f"the fleet (the same secret)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"seeding secret {path}: not a regular file")
        if st.st_uid not in owners:
            raise SecretError(f"seeding secret {path}: owned by uid {st.st_uid}; it must belong to root or the "
                              f"service user")
        if st.st_mode & 0o077:
            raise SecretError(f"seeding secret {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others "
                              f"read or write it; chmod 0600 {path}")
        raw = os.read(fd, 64 * 1024)
    finally:
        os.close(fd)
    keys = []
    for line in raw.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) < MIN_SECRET_CHARS:
            raise SecretError(f"seeding secret {path}: a line of {len(line)} characters; each secret needs at "
                              f"least {MIN_SECRET_CHARS} (openssl rand -hex 32)")
        keys.append(line.encode())
    if not keys:
        raise SecretError(f"seeding secret {path}: holds no secret (one per line, the signing one first)")
    return Secret(tuple(keys), path)
