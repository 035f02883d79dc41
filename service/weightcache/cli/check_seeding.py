"""``weightcache check-config``'s part for peer seeding (issue 37): the secret, NIXL, the peers.

Forbidden imports: torch, weightcache.daemon.
"""

from __future__ import annotations

import socket
from typing import Any

from ..seeding import (
    Channel,
    ChannelError,
    NixlMissing,
    SecretError,
    SeedSettings,
    load_secret,
    nixl_api,
    parse_address,
)


def check_seeding(svc: Any, gpus: list[int]) -> tuple[list[str], list[str], list[str]]:
    """Lines to print, warnings and problems for ``[service]``'s seeding keys (``svc``: ``ServiceConfig``).

    A secret that cannot be read (as the user running the check: the service user under root) and a peer
    that shares no secret with this node are problems; NIXL missing and a peer not answering a seeding
    hello within 3 s are warnings (a peer may be down now and back later; the service then reads its
    checkpoints itself).
    """
    st = SeedSettings(peers=tuple(svc.peers), peers_file=svc.peers_file, secret_file=svc.seed_secret_file,
                      listen=svc.seed_listen)
    if not st.enabled:
        return [], [], []
    lines, warnings, problems = [], [], []
    try:
        secret = load_secret(st.secret_file)
        lines.append(f"seeding: secret {st.secret_file} readable ({len(secret.keys)} "
                     f"secret{'s' if len(secret.keys) != 1 else ''}: the first signs, all are accepted)")
    except SecretError as e:
        secret = None
        problems.append(f"{e}; seeding is off until it is fixed")
    try:
        nixl_api()
    except NixlMissing as e:
        warnings.append(f"seeding is off: {e}")
    if st.listen:
        host, port = parse_address(st.listen)
        lines.append("seeding: serving peers on " + ", ".join(f"{host}:{port + g} (GPU {g})" for g in gpus)
                     + f" transport={svc.seed_transport}")
    peers = st.all_peers()
    if (st.peers or st.peers_file) and not peers:
        warnings.append(f"seeding: peers_file {st.peers_file} lists no peer (yet): every load reads its checkpoint")
    for peer in peers:
        warning, problem = _check_peer(peer, secret, lines)
        warnings += warning
        problems += problem
    return lines, warnings, problems


def _check_peer(peer: str, secret: Any, lines: list[str]) -> tuple[list[str], list[str]]:
    """Connects to ``peer``, reads its hello and, with a secret, sends a signed ``probe`` request and checks
    the signed reply: reachable, a weightcache seeding listener of the same protocol version, and the two
    nodes share a secret (a ``probe`` asks for no slab; a source older than it answers a refusal, signed
    all the same). Returns ``(warnings, problems)``: a peer down is a warning (it may come back), a peer
    that refuses this node's signature or whose reply this node cannot verify is a problem (every transfer
    from it would be refused ``auth``)."""
    try:
        host, port = parse_address(peer)
        with socket.create_connection((host, port), timeout=3.0) as s:
            s.settimeout(3.0)
            ch = Channel(s, secret, server=False)
            ch.open()
            if secret is not None:
                ch.send("request", {"probe": True, "model": "", "tp_size": 0, "tp_rank": -1, "samples": []})
                ch.recv("reply")
    except ValueError as e:
        return [f"seeding: peer {e}"], []
    except OSError as e:
        return [f"seeding: peer {peer} is not reachable ({e.strerror or e}); loads will skip it"], []
    except ChannelError as e:
        if e.reason == "auth":
            return [], [f"seeding: peer {peer}: {e}; every transfer between the two is refused (auth) and "
                        "loads read their checkpoints (compare the seed_secret_file of both nodes; "
                        "docs/configuration.md, \"Secret rotation\")"]
        if e.reason in ("disconnected", "timeout") and secret is not None:
            return [f"seeding: peer {peer} answered its hello but not a signed probe ({e.reason}: {e})"], []
        return [f"seeding: peer {peer} answers, but not as a weightcache seeding listener: {e}"], []
    lines.append(f"seeding: peer {peer} reachable" + (", the secret is shared" if secret is not None else ""))
    return [], []
