"""``weightcache status`` and ``weightcache list``: what is resident, loading or failed, and who holds leases.

Every :class:`~weightcache.wire.SlotState` has its rendering (:func:`state_text`).

Forbidden imports: torch, weightcache.daemon, weightcache.client, weightcache.pipeline, weightcache.memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .. import protocol
from ..session import listening_gpus
from ..wire import SlotState
from .common import (EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, collect_status, format_age, human_bytes, lease_holder,
                     no_sockets, plural, socket_dir_of)


def progress_text(sl: protocol.SlabInfo) -> str:
    """``1.2 GiB/12.6 GiB (9%) 2.10 GB/s, ~5s left`` for a loading slab; ``planning (reading the checkpoint's
    headers)`` while its size is not known yet (never ``0 B/0 B 0.00 GB/s``); no rate before one is measured."""
    done, total, rate = sl.done_bytes, sl.total_bytes, sl.rate_bytes_per_s
    if not total:
        return "planning (reading the checkpoint's headers)"
    text = f"{human_bytes(done)}/{human_bytes(total)}"
    if total:
        text += f" ({100.0 * done / total:.0f}%)"
    if rate > 0:
        text += f" {rate / 1e9:.2f} GB/s"
    if rate > 0 and total > done:
        text += f", ~{format_age((total - done) / rate)} left"
    return text


def larger_than_budget(sl: protocol.SlabInfo) -> tuple[int, int] | None:
    """(slab bytes, ``memory_budget_bytes``) when the slab's last load was refused ``insufficient_memory``
    because the slab alone is larger than the whole budget (it can never load); else None."""
    if sl.error is None or sl.error.code != "insufficient_memory":
        return None
    need, budget = sl.error.details.get("need_bytes", 0), sl.error.details.get("budget_bytes", 0)
    return (need, budget) if isinstance(need, int) and isinstance(budget, int) and need > budget > 0 else None


def state_text(sl: protocol.SlabInfo) -> str:
    """The slab's state for humans: its :class:`~weightcache.wire.SlotState` value first, then what it means."""
    match sl.state:
        case SlotState.LOADING:
            return f"loading {progress_text(sl)}"
        case SlotState.READY if sl.demoting:
            return "ready (being demoted: copying to the host tier, serving from the GPU until the copy is sealed)"
        case SlotState.READY if sl.adopted:
            return "ready (adopted from fd store; leases from before the restart unknown)"
        case SlotState.FAILED if sl.error is not None:
            return f"failed: {sl.error.code}"
        case SlotState.WAITING_FOR_ENGINE:
            why = f" ({sl.error.code})" if sl.error is not None else ""
            return (f"waiting_for_engine{why}: the service cannot lay it out; the first engine started with "
                    f"--load-format weightcache publishes it")
        case SlotState.EVICTED:
            return "evicted (run `weightcache preload` to load again)"
        case SlotState.RETIRED:
            return f"retired: replaced or removed by a reload, freed when its {plural(sl.lease_count, 'lease')} end"
        case SlotState.DROPPED:
            return "dropped: removed from the config"
        case SlotState.HOSTED:
            return f"hosted: in the host tier ({human_bytes(sl.host_bytes)}; the next attach promotes it)"
        case SlotState.ON_DISK if sl.error is not None and sl.error.code == "insufficient_memory":
            if (over := larger_than_budget(sl)) is not None:  # no attach can ever load it
                return (f"on_disk: larger than memory_budget_bytes ({human_bytes(over[0])} > {human_bytes(over[1])}; "
                        f"no attach can load it: raise memory_budget_bytes)")
            return "on_disk: not resident (the last load got no room: insufficient_memory; the next attach tries again)"
        case SlotState.ON_DISK:
            return "on_disk: not resident (the next attach loads it)"
    return sl.state.value  # pending, and ready or failed without more to say


def print_status(st: protocol.ServiceStatus, now: float) -> None:
    dev = st.device
    resident = sum(sl.resident_bytes for sl in st.slabs)
    leases = sum(sl.lease_count for sl in st.slabs)
    where = "GPU" if st.backend == "cuda" else "host RAM"
    head = f"GPU {st.gpu}  backend={st.backend}"
    if dev.gpu_uuid:
        head += f"  uuid={dev.gpu_uuid}"
    if dev.compute_capability:
        head += f"  sm={dev.compute_capability}"
    print(f"{head}  service pid={st.pid}")
    slabs = plural(sum(sl.resident_bytes > 0 for sl in st.slabs), "slab")
    print(f"  resident {human_bytes(resident)} in {slabs}; "
          f"{where} free {human_bytes(st.free_bytes)} of {human_bytes(st.total_bytes)}; "
          f"{plural(leases, 'lease')}"
          + (" (+ unknown from before the restart)" if any(sl.adopted and sl.state is SlotState.READY
                                                           for sl in st.slabs) else ""))
    if st.budget_bytes:
        tier = (f"; host tier {human_bytes(st.host_used_bytes)} of {human_bytes(st.host_tier_bytes)}"
                if st.host_tier_bytes else "")
        print(f"  memory budget {human_bytes(st.gpu_bytes)} of {human_bytes(st.budget_bytes)} used{tier}")
    print(f"  {st.status_line}")
    if st.config_error is not None:
        d = st.config_error.details
        print(f"  configuration rejected: {st.config_error.message}" + (f" (line {d['line']})" if d.get("line") else ""))
        print(f"      serving the previous configuration; fix the file, check it with `weightcache check-config`, "
              f"then `systemctl reload weightcache@{st.gpu}`")
    for sl in st.slabs:
        print(f"  {sl.label:<32} {state_text(sl)}")
        if sl.resident_bytes or sl.tensors:
            print(f"      resident {human_bytes(sl.resident_bytes)} ({sl.resident_bytes} bytes), "
                  f"{sl.tensors} tensors, {sl.path}" + (f", source {sl.source}" if sl.source and not sl.peer else ""))  # a peer: its own line
        else:
            print(f"      {sl.path}")
        if sl.error is not None:
            print(f"      reason: {sl.error.message}")
        if sl.peer:  # issue 37: fetched, processed, from a peer service of the fleet
            print(f"      source: peer {sl.peer}")
        pub = sl.publication
        if pub is not None:  # an engine processed it: its key is the engine's, not the configured dtype and naming
            print(f"      published by {pub.get('engine')} {pub.get('engine_version')} (uid {pub.get('publisher_uid')}, "
                  f"{'shared' if pub.get('shared') else 'its own uid only'}), engine key "
                  f"{str(pub.get('engine_key_blake2b'))[:16]}, arch={sl.key.architecture if sl.key else '?'}")
        elif sl.key is not None:
            k = sl.key
            print(f"      key: arch={k.architecture} dtype={sl.dtype} naming={sl.naming} "
                  f"quant={k.quant_scheme or 'none'} files={k.files} pipeline=v{k.pipeline_version}")
        for le in sl.leases:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(le.since))
            print(f"      lease {le.lease_id}: {lease_holder(le)} mode={le.mode} "
                  f"since {since} ({format_age(now - le.since)} ago)")
        if sl.lease_count > len(sl.leases):  # the service lists the first leases and counts the rest by holder
            print(f"      ... {sl.lease_count - len(sl.leases)} more; by holder: "
                  + ", ".join(f"uid {h.uid} pid {h.pid}: {h.count}" for h in sl.lease_holders))


def cmd_status(args: argparse.Namespace) -> int:
    from .unwired import disabled_gpus, disabled_lines, gpus_without_instance, warnings

    statuses, errors = collect_status(args)
    where = socket_dir_of(args)
    listening = listening_gpus(where)
    failed = any(sl.state is SlotState.FAILED for st in statuses for sl in st.slabs) or any(
        st.config_error is not None for st in statuses)
    if args.json:
        unwired = gpus_without_instance(listening) if args.gpu is None else {}
        off = disabled_gpus() if args.gpu is None else {}
        print(json.dumps({"gpus": [st.to_json() for st in statuses], "unreachable": [e.to_json() for e in errors],
                          "no_instance": [{"gpu": g, "models": m} for g, m in unwired.items()],
                          "disabled": [{"gpu": g, "models": m} for g, m in off.items()]}, indent=2))
    else:
        if not statuses and not errors:
            print(no_sockets(args), file=sys.stderr)
        now = time.time()
        for st in statuses:
            print_status(st, now)
        for e in errors:
            print(f"GPU {e.gpu}  unreachable: {e.message}")
            if "Permission denied" not in e.message:  # that message names its own fix
                print(f"      under systemd, why: systemctl status weightcache@{e.gpu}.socket weightcache@{e.gpu}"
                      f".service; journalctl -u weightcache@{e.gpu}")
        for line in warnings(where, listening) if args.gpu is None else ():
            print(line, file=sys.stderr)
        for line in disabled_lines(disabled_gpus()) if args.gpu is None else ():
            print(line)
    if not statuses:
        return EXIT_UNAVAILABLE
    if failed:
        return EXIT_FAILED
    return EXIT_UNAVAILABLE if errors else EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    statuses, errors = collect_status(args)
    rows = [(st.gpu, sl) for st in statuses for sl in st.slabs]
    if args.json:
        print(json.dumps([dict(sl.to_json(), gpu=gpu) for gpu, sl in rows], indent=2))
    elif statuses:
        states = [sl.state.value + ("*" if sl.adopted else "") for _, sl in rows]
        w = max([9, *map(len, states)])  # waiting_for_engine is longer than the others
        print(f"{'GPU':<4} {'MODEL':<24} {'TP':>3} {'RANK':>4} {'STATE':<{w}} {'RESIDENT':>10} {'LEASES':>6}  PATH")
        for (gpu, sl), state in zip(rows, states):
            print(f"{gpu:<4} {sl.model:<24} {sl.tp_size:>3} {sl.tp_rank:>4} {state:<{w}} "
                  f"{human_bytes(sl.resident_bytes):>10} {sl.lease_count:>6}  {sl.path}")
        if any(sl.adopted for _, sl in rows):
            print("* adopted from the fd store")
    if not args.json:
        if not statuses and not errors:
            print(no_sockets(args), file=sys.stderr)
        for e in errors:
            print(f"GPU {e.gpu} unreachable: {e.message}", file=sys.stderr)
    return EXIT_UNAVAILABLE if not statuses else EXIT_OK
