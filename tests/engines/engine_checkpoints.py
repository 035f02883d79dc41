"""Tiny checkpoints by transformers for the engine tests, one builder for every test module that uses them.

Architectures without weightcache layout rules (Qwen3, Qwen3-MoE, Phi-3, OLMoE, Gemma 2, Granite, DeepSeek-V3),
float32, random weights (``torch.manual_seed``) with every norm's weight drawn around 1 (a model whose norms are all
ones or zeros gives flat logits). :func:`build` writes the same bytes wherever it is called, so one module's
default-loader reference run serves every other module that builds the same family (default_loader_runs.py).
"""

from __future__ import annotations

from pathlib import Path

#: Tiny configs of architectures weightcache has no layout rules for: MoE (Qwen3-MoE; OLMoE, with q/k norms;
#: DeepSeek-V3, with MLA), a checkpoint that stores fused tensors (Phi-3: qkv_proj, gate_up_proj), Gemma 2
#: (soft-capping, sliding window), Granite (scaled residuals).
CONFIGS = {
    # Qwen3 with a 32768-row tied vocabulary (16 MB of its 17 MB: the weights stand out of an engine's private
    # memory); q/k norms.
    "qwen3": ("Qwen3Config", dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, vocab_size=32768, max_position_embeddings=64,
                                  tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         vocab_size=151, max_position_embeddings=64, decoder_sparse_step=1,
                                         tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])),
    "phi3": ("Phi3Config", dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, vocab_size=151, max_position_embeddings=64, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, architectures=["Phi3ForCausalLM"])),
    "olmoe": ("OlmoeConfig", dict(hidden_size=128, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  vocab_size=151, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, architectures=["OlmoeForCausalLM"])),
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                             n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=64,
                                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, vocab_size=151, max_position_embeddings=64,
                                             rope_scaling=None, tie_word_embeddings=False, topk_method="noaux_tc",
                                             architectures=["DeepseekV3ForCausalLM"])),
    "gemma2": ("Gemma2Config", dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=151,
                                    max_position_embeddings=64, sliding_window=32, architectures=["Gemma2ForCausalLM"])),
    "granite": ("GraniteConfig", dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=151,
                                      max_position_embeddings=64, architectures=["GraniteForCausalLM"])),
}



def build(dest: Path, family: str, *, seed: int = 11) -> Path:
    """Writes the tiny ``family`` model (:data:`CONFIGS`) to ``dest`` with ``save_pretrained``; returns ``dest``.

    Args:
        dest (`Path`): a directory (created).
        family (`str`): a key of :data:`CONFIGS`.
        seed (`int`): ``torch.manual_seed`` before initialisation; the same seed gives the same bytes.

    Raises:
        KeyError: ``family`` is not in :data:`CONFIGS`.
    """
    import torch
    import transformers

    cls, fields = CONFIGS[family]
    config = getattr(transformers, cls)(initializer_range=0.1, rms_norm_eps=1e-6, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(dest)
    return Path(dest)
