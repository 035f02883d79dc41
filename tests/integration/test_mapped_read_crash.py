"""A checkpoint cut while a row-parallel shard is copied from its mapping (docs/reliability.md, "A checkpoint
truncated while it is being read"): a real ``weightcache serve`` subprocess and the fd store stood in for.

The cut is made deterministic by a ``sitecustomize`` hook in the service process: the first time the reader
probes the page cache for a piece of the chosen file (:func:`weightcache.reader._rows.in_page_cache`, called once the
piece's span is mapped and just before its rows are copied), the hook truncates that file to 0 bytes, as
``cp new.safetensors model.safetensors`` does (``O_TRUNC``) to a file being read.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service_harness import SERVICE_DIR, FdStoreStandIn, ServiceProcess, make_config, poll_until, to_toml  # noqa: E402
from checkpoints import compare_bytes, llama_checkpoint, read_checkpoint  # noqa: E402
from weightcache import attach, protocol  # noqa: E402
from weightcache.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(180)

HOOK = """\
import os
target = os.environ.get("WC_TEST_CUT_WHEN_MAPPED")
if target:
    import weightcache.reader._rows as row_reads
    probe = row_reads.in_page_cache

    def cut_then_probe(fd, offset):
        st, want = os.fstat(fd), os.stat(target)
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) and want.st_size:
            os.truncate(target, 0)
        return probe(fd, offset)

    row_reads.in_page_cache = cut_then_probe
"""


def test_a_file_cut_during_the_mapped_copy_kills_the_service_and_the_restart_keeps_the_other_models(tmp_path):
    """Model ``a`` is resident; model ``b`` (TP 2, row-parallel shards copied from a mapping of its file) is
    loaded and its file cut to 0 bytes during the copy: the service dies with ``SIGBUS`` and its log shows the
    reader's Python stack (``faulthandler``: the journal says which copy it was). Restarted with the fd store,
    it adopts ``a`` (the same bytes, nothing read from disk) and ``b`` fails with ``checkpoint_corrupt`` naming
    its file."""
    a = llama_checkpoint(tmp_path / "a", seed=1, files=1)
    b = llama_checkpoint(tmp_path / "b", seed=2, files=1, inter=4096)
    b_file = next(b.glob("*.safetensors"))
    cfg, listen, log = tmp_path / "weightcache.toml", tmp_path / "0.sock", tmp_path / "serve.log"
    cfg.write_text(to_toml(make_config({"a": a, "b": {"path": b, "naming": "vllm", "preload": "disk",
                                                       "layouts": [{"tp": 2, "gpus": [0, 0]}]}})))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    want_a = read_checkpoint(a)

    def request(msg):
        s = Session(str(listen), timeout=10)
        try:
            return s.request(msg)
        finally:
            s.close()

    def slabs() -> dict | None:
        try:
            st = request(protocol.Status()).status
        except Exception:  # noqa: BLE001 - not up (yet)
            return None
        return {(s["model"], s["tp_rank"]): s for s in st["slabs"]}

    with FdStoreStandIn(tmp_path / "notify.sock") as store:
        env = {"NOTIFY_SOCKET": store.path, "WC_TEST_CUT_WHEN_MAPPED": str(b_file),
               "PYTHONPATH": os.pathsep.join([str(hook), str(SERVICE_DIR)])}
        first = ServiceProcess(tmp_path, cfg, 0, "host", env=env)
        first.socket_path, first.log_path, first.listen_fds = str(listen), log, dict(store.fds)
        proc = first.launch().proc
        store.procs.append(proc)
        store.collect(2, log=log.read_text)  # a's slab and manifest
        request(protocol.Preload("b"))
        rc = proc.wait(timeout=60)
        assert b_file.stat().st_size == 0  # the hook did cut it
        crash = log.read_text()
        fatal = re.findall(r"^Fatal Python error: (.*)$", crash, re.M)
        # The bus error comes first, in the reader's copy. faulthandler then dumps every thread's stack while
        # the other reader threads run on, which it documents as unsafe: under load that dump was once seen to
        # fault itself (SIGSEGV, a second "Fatal Python error: Segmentation fault"). Either way the service
        # died of the bus error of the mapped copy, which is what this test is about.
        assert fatal and fatal[0] == "Bus error", crash[-3000:]
        assert rc == -signal.SIGBUS or (rc == -signal.SIGSEGV and fatal[1:2] == ["Segmentation fault"]), (
            rc, crash[-3000:])
        assert "copy_mapped_rows" in crash, crash[-3000:]

        second = store.serve(cfg, listen, log)
        st = poll_until(slabs, "the restarted service to answer", 90, detail=log.read_text)
        assert (st[("a", 0)]["state"], st[("a", 0)]["adopted"]) == ("ready", True), st
        with attach(str(a), socket_dir=str(tmp_path), fallback=False, timeout=60) as w:
            compare_bytes(w.tensors, want_a)
        assert "loaded model=a" not in log.read_text().split(crash, 1)[1]  # nothing read from disk
        request(protocol.Preload("b"))
        st = poll_until(lambda: (s := slabs()) and all(s[("b", r)]["state"] == "failed" for r in (0, 1)) and s,
                        "b to fail", 60, detail=log.read_text)
        for r in (0, 1):
            err = st[("b", r)]["error"]
            assert err["code"] == "checkpoint_corrupt" and err["details"]["file"] == str(b_file), err
        assert second.poll() is None
