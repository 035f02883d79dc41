"""Journal entries about a slab say which layout: ``tp_size`` in the text and ``WEIGHTCACHE_TP_SIZE=``.

A model with two layouts has a rank 0 in each, often on the same GPU (``layouts = [ { tp = 1, gpus = [0] },
{ tp = 2, gpus = [0, 1] } ]``). ``load failed``, ``released``, ``evicted`` and others said only
``model=llama rank=0``, and the entries had no field for the layout, so ``journalctl WEIGHTCACHE_MODEL=llama
WEIGHTCACHE_RANK=0`` could not tell which slab failed.
"""

from __future__ import annotations

import logging

from weightcache.config import ModelConfig, Placement
from weightcache.daemon.load_results import Failed
from weightcache.daemon.state import ServiceState
from weightcache.errors import CheckpointCorrupt


def test_a_failed_load_names_its_layout(caplog):
    m = ModelConfig("llama", "/srv/models/llama")
    st = ServiceState(0, "host", {}, [Placement(m, 1, 0, 0), Placement(m, 2, 0, 0)])
    caplog.set_level(logging.ERROR, logger="weightcache.daemon.load_results")
    for slot in st.slots:
        slot.start(0.0)
        Failed(slot, CheckpointCorrupt("bad header")).apply(st)
    got = [(r.getMessage().split(" code=")[0], r.WEIGHTCACHE_MODEL, r.WEIGHTCACHE_TP_SIZE, r.WEIGHTCACHE_RANK)
           for r in caplog.records]
    assert got == [("load failed model=llama tp_size=1 rank=0", "llama", "1", "0"),
                   ("load failed model=llama tp_size=2 rank=0", "llama", "2", "0")]
