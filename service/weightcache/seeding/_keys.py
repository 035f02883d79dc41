"""What a receiver checks of a peer's offer before one byte of it is read: the key and the manifest.

The cache key's ``checkpoint`` (DESIGN §5) holds ``stat()`` fields (inode, mtime, ctime) that differ on
every node even for the same files. Between nodes the checkpoint is the same when its **portable
identity** is: every file's size and header hash, whether it has an index, and the hashes of
``config.json`` and ``hf_quant_config.json`` — all computed by the receiver from its own copy of the
headers (:func:`portable_identity`), never taken from the peer. Headers fix every tensor's name, dtype,
shape and byte range, so equal headers and sizes mean the same plan; the tensor bytes themselves are
checked by their digests after the READ.

The device in the key: the ``backend`` and ``compute_capability`` must be equal, the ``gpu_uuid`` of
course differs between nodes and is not compared.

Forbidden imports: torch, socket, weightcache.daemon, nixl.
"""

from __future__ import annotations

from typing import Any

from ..identity import diff_keys

#: Layout fields of a tensor record that must be equal to the receiver's own plan (all but the digest).
RECORD_FIELDS = ("name", "dtype", "shape", "stride", "offset_bytes", "size_bytes", "layout", "alias_of")


def portable_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """The node-independent part of a checkpoint identity (:meth:`weightcache.checkpoint.Checkpoint.identity`).

    Example:
        >>> portable_identity({"files": {"a": {"size": 8, "inode": 3, "mtime_ns": 1, "ctime_ns": 1,
        ...   "header_blake2b": "h"}}, "index": None, "config_json_blake2b": "c", "quant_config_blake2b": "q"})
        {'files': {'a': {'size': 8, 'header_blake2b': 'h'}}, 'index': False, 'config_json_blake2b': 'c', \
'quant_config_blake2b': 'q'}
    """
    files = identity.get("files") or {}
    return {
        "files": {n: {"size": f.get("size"), "header_blake2b": f.get("header_blake2b")} for n, f in files.items()},
        "index": identity.get("index") is not None,
        "config_json_blake2b": identity.get("config_json_blake2b"),
        "quant_config_blake2b": identity.get("quant_config_blake2b"),
    }


def key_differences(own: dict[str, Any], peer: Any) -> tuple[str, list[str]]:
    """Compares a peer's cache key with this node's (the plan's): ``("", [])`` when they agree.

    Returns:
        `tuple[str, list[str]]`: the reason (``wrong_checkpoint``: another checkpoint, by its portable
        identity; ``key_mismatch``: another dtype, naming, layout, pipeline version, device kind...) and the
        dotted fields that differ.
    """
    if not isinstance(peer, dict):
        return "key_mismatch", ["<key>"]
    ck = diff_keys(portable_identity(own.get("checkpoint") or {}),
                   portable_identity(peer.get("checkpoint") or {}) if isinstance(peer.get("checkpoint"), dict)
                   else {}, "checkpoint")
    if ck:
        return "wrong_checkpoint", ck
    strip = ("checkpoint", "device")
    rest = diff_keys({k: v for k, v in own.items() if k not in strip},
                     {k: v for k, v in peer.items() if k not in strip})
    dev_own, dev_peer = own.get("device") or {}, peer.get("device") if isinstance(peer.get("device"), dict) else {}
    rest += [f"device.{k}" for k in ("backend", "compute_capability") if dev_own.get(k) != dev_peer.get(k)]
    return ("key_mismatch", rest) if rest else ("", [])


def record_differences(planned: Any, offered: Any) -> list[str]:
    """Names of the tensors whose layout in the peer's manifest (``offered``) differs from the receiver's own
    plan (``planned``), both sequences of :class:`~weightcache.manifest.TensorRecord`; ``["<count>"]`` when
    the counts differ."""
    planned, offered = list(planned), list(offered)
    if len(planned) != len(offered):
        return ["<count>"]
    bad = []
    for a, b in zip(planned, offered):
        if any(_norm(getattr(a, f)) != _norm(getattr(b, f)) for f in RECORD_FIELDS):
            bad.append(a.name)
    return bad


def _norm(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v
