"""Load: 64 concurrent clients attaching and releasing in a loop for a bounded time.

64 engine threads in this process (64 connections, each its own lease) attach
one of two models (zero-copy or copy mode), compare every byte with the
checkpoint, and close, until the deadline. A sampler thread reads the
service's fd count and RSS from ``/proc`` meanwhile. Afterwards: no error,
identical bytes every time, fds back to the baseline, RSS flat.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from service_harness import proc_fds, proc_rss_bytes, record_figures  # noqa: E402
from checkpoints import llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CLIENTS = 64
LOAD_S = 8.0
MiB = 1 << 20
RSS_GROWTH_LIMIT_BYTES = 32 * MiB


def test_64_clients_attach_release_loop(daemon, tmp_path):
    cks = {"a": llama_checkpoint(tmp_path / "a", seed=51), "b": llama_checkpoint(tmp_path / "b", seed=52)}
    svc = daemon(cks)
    svc.wait_settled()
    ref = {m: {k: v.reshape(-1).view(torch.uint8) for k, v in read_checkpoint(p).items()} for m, p in cks.items()}
    for m in ref:  # warm-up: first attach of each model in this process
        attach(str(cks[m]), socket_dir=svc.socket_dir, fallback=False).close()
    base = svc.snapshot()

    stop = threading.Event()
    start = threading.Barrier(CLIENTS + 1)
    lock = threading.Lock()
    stats = {"attaches": 0, "bytes": 0, "errors": [], "max_fds": 0, "rss": [], "per_model": {"a": 0, "b": 0}}

    def engine(i: int) -> None:
        model = "ab"[i % 2]
        mode = "copy" if i % 4 == 3 else "zero_copy"
        n = nbytes = 0
        start.wait()
        try:
            while not stop.is_set():
                w = attach(str(cks[model]), socket_dir=svc.socket_dir, fallback=False, mode=mode, timeout=60)
                try:
                    if w.source != "daemon" or w.manifest.model != model:
                        raise AssertionError(f"client {i}: source={w.source} model={w.manifest.model}")
                    for k, want in ref[model].items():
                        got = w.tensors[k].reshape(-1).view(torch.uint8)
                        if not torch.equal(got, want):
                            raise AssertionError(f"client {i}: bytes of {model}:{k} differ")
                        nbytes += want.numel()
                finally:
                    w.close()
                n += 1
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            with lock:
                stats["errors"].append(repr(e))
        with lock:
            stats["attaches"] += n
            stats["bytes"] += nbytes
            stats["per_model"][model] += n

    def sampler() -> None:
        while not stop.wait(0.25):
            fds = sum(proc_fds(svc.pid).values())
            with lock:
                stats["max_fds"] = max(stats["max_fds"], fds)
                stats["rss"].append(proc_rss_bytes(svc.pid))

    threads = [threading.Thread(target=engine, args=(i,), name=f"engine-{i}") for i in range(CLIENTS)]
    for t in threads:
        t.start()
    mon = threading.Thread(target=sampler)
    mon.start()
    start.wait()
    t0 = time.monotonic()
    stop.wait(LOAD_S)
    stop.set()
    for t in threads:
        t.join(120)
    mon.join(10)
    duration = time.monotonic() - t0

    assert stats["errors"] == []
    # Issue 39: the connections the engines closed are reaped while others keep connecting. An unbounded
    # accept loop held 2,577 sockets for these 64 clients on a CPU-starved node (562 on an idle one), and at
    # a 1,024-fd limit dropped every client ("closed the connection").
    assert stats["max_fds"] <= sum(base["fds"].values()) + 4 * CLIENTS, stats["max_fds"]
    assert stats["per_model"]["a"] > 0 and stats["per_model"]["b"] > 0
    after = svc.snapshot()
    assert after["leases"] == 0
    assert after["fds"] == base["fds"], (base["fds"], after["fds"])
    rss = stats["rss"]
    assert len(rss) >= 4
    # Flat: the end of the run is not above its first quarter by more than the limit, nor the end
    # state above the baseline.
    early = max(rss[: max(1, len(rss) // 4)])
    assert max(rss[len(rss) // 2:]) - early < RSS_GROWTH_LIMIT_BYTES, [r // MiB for r in rss]
    assert after["rss_bytes"] - base["rss_bytes"] < RSS_GROWTH_LIMIT_BYTES
    assert svc.alive()
    record_figures(
        "load.64_clients", f"Load: {CLIENTS} concurrent clients attach/compare/release in a loop",
        "no error; every attach byte-identical to its own model's checkpoint (2 models, zero-copy and copy); "
        "no lease left; service fds equal before/after; RSS flat (< 32 MiB growth)",
        clients=CLIENTS, duration_s=round(duration, 2), attaches=stats["attaches"],
        bytes_compared=stats["bytes"], max_service_fds=stats["max_fds"],
        service_fds_before=sum(base["fds"].values()), service_fds_after=sum(after["fds"].values()),
        rss_before_bytes=base["rss_bytes"], rss_after_bytes=after["rss_bytes"],
        rss_max_during_bytes=max(rss), faults_injected=0)
