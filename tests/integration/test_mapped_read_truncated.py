"""A checkpoint cut while a row-parallel shard is copied from its mapping (issue 38, P7; docs/reliability.md, "A
checkpoint truncated while it is being read"): a real ``weightcache serve`` subprocess, as an unprivileged uid.

The cut is made deterministic by a ``sitecustomize`` hook in the service process: the first time the reader
probes the page cache for a piece of the chosen file (:func:`weightcache.reader._rows.in_page_cache`, called once the
piece's span is mapped and just before its rows are copied), the hook truncates that file to 0 bytes, as
``cp new.safetensors model.safetensors`` does (``O_TRUNC``) to a file being read. Before the guarded copy the
service died with ``SIGBUS`` here (every engine's lease with it).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from attackers import SERVICE_UID  # noqa: E402
from service_harness import SERVICE_DIR, ServiceProcess, make_config, poll_until, record_figures  # noqa: E402
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402

pytestmark = pytest.mark.timeout(180)

HOOK = """\
import os
target = os.environ.get("WC_TEST_CUT_WHEN_MAPPED")
if target:
    from weightcache.reader import _rows as row_reads
    probe = row_reads.in_page_cache

    def cut_then_probe(fd, offset):
        st, want = os.fstat(fd), os.stat(target)
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) and want.st_size:
            os.truncate(target, 0)
        return probe(fd, offset)

    row_reads.in_page_cache = cut_then_probe
"""


def test_a_file_cut_during_the_mapped_copy_fails_that_model_only(tmp_path):
    """Model ``a`` is resident; model ``b`` (TP 2, row-parallel shards copied from a mapping of its file) is
    loaded and its file cut to 0 bytes during the copy: the service lives (same pid), both of ``b``'s slabs fail
    with ``checkpoint_corrupt`` naming its file, and ``a`` still serves its bytes."""
    work = tmp_path / "w"
    work.mkdir()
    os.chmod(tmp_path, 0o755)
    a = llama_checkpoint(tmp_path / "a", seed=1, files=1)
    b = llama_checkpoint(tmp_path / "b", seed=2, files=1, inter=4096)
    b_file = next(b.glob("*.safetensors"))
    os.chmod(b_file, 0o666)  # the hook runs as the service's uid
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    want_a = read_checkpoint(a)
    cfg = make_config({"a": a, "b": {"path": b, "naming": "vllm", "preload": "disk",
                                     "layouts": [{"tp": 2, "gpus": [0, 0]}]}})
    env = {"WC_TEST_CUT_WHEN_MAPPED": str(b_file), "PYTHONPATH": os.pathsep.join([str(hook), str(SERVICE_DIR)])}
    svc = ServiceProcess(work, cfg, 0, "host", env=env, run_as=SERVICE_UID).start()
    try:
        pid = svc.pid
        svc.request(protocol.Preload("b"))

        def b_failed():
            slabs = {(s["model"], s["tp_rank"]): s for s in svc.status()["slabs"]}
            return all(slabs.get(("b", r), {}).get("state") == "failed" for r in (0, 1)) and slabs

        slabs = poll_until(b_failed, "b to fail", 60, detail=svc.log)
        assert b_file.stat().st_size == 0  # the hook did cut it
        assert svc.proc.poll() is None and svc.pid == pid, svc.log()
        for r in (0, 1):
            err = slabs[("b", r)]["error"]
            assert err["code"] == "checkpoint_corrupt" and err["details"]["file"] == str(b_file), err
        assert "Bus error" not in svc.log()
        with attach(str(a), socket_dir=svc.socket_dir, fallback=False, timeout=60) as w:
            assert w.source == "daemon"
            compared = compare_bytes(w.tensors, want_a)
    finally:
        svc.kill()
    record_figures("faults.bad_checkpoint.cut_during_mapped_read", "Checkpoint cut to 0 bytes during a TP-2 rank's "
                   "mapped row copy", "service as uid 64000 lives (same pid): both ranks checkpoint_corrupt naming "
                   "the file (the rows copied by process_vm_readv: a short count, not SIGBUS); the other model "
                   "serves identical bytes", clients=1, faults_injected=1, bytes_compared=compared)
