"""Decode attention that reads grouped K/V once instead of copying it n_rep times (query folding).

    from gpu.attention import use_gqa_decode
    use_gqa_decode(model)   # True: switched; False: no GQA or not on sdpa, nothing changed

A GQA model has H query heads and Hkv < H key/value heads; query head h reads KV head
h // n_rep, n_rep = H / Hkv (transformers' repeat_kv). Under torch.compile, transformers' sdpa path
copies the whole KV cache n_rep times every decode step (repeat_kv), because it passes
enable_gqa=True to SDPA only without a mask (a static cache always has one) and packs the query
only outside dynamo. For one new token (L = 1) the n_rep heads that share a KV head are instead
stacked along the query-length axis, and SDPA runs once on the un-repeated K/V:

    q (B, H, 1, D) -> (B, Hkv, n_rep, D)        row r of KV head g is query head g*n_rep + r
    o = softmax(q K^T * scale + mask) V          K, V (B, Hkv, S, D); mask (B, 1, 1, S) broadcasts
    o (B, Hkv, n_rep, D) -> (B, 1, H, D)         transformers' attention output layout

Every query row attends to all S cached positions the mask allows, so is_causal is False (a causal
flag would hide positions from the folded rows r > 0). Prefill (L > 1), masks with a head axis,
position biases, softcaps and paged caches go to transformers' own sdpa function unchanged:
prefill runs once, uncompiled, and without a mask there it already gets flash with enable_gqa.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_gqa_fold"  # contains "sdpa": transformers checks SDPA support for it as for "sdpa"


def gqa_fold_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, L, D), key/value (B, Hkv, S, D), mask
    (B, 1, L, S) or None -> ((B, L, H, D), None)."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    B, H, L, D = query.shape
    special = any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))
    folds = (n_rep > 1 and L == 1 and not special
             and (attention_mask is None or attention_mask.shape[1] == 1))
    if not folds:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    q = query.reshape(B, H // n_rep, n_rep, D)  # (B, Hkv, n_rep, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=False)  # (B, Hkv, n_rep, Dv)
    return out.reshape(B, H, 1, -1).transpose(1, 2).contiguous(), None  # (B, 1, H, Dv)


def register() -> str:
    """Make NAME a valid attn_implementation: the attention and its mask (sdpa's, the same one).
    Without the mask entry transformers would build no mask at all for a custom name."""
    AttentionInterface.register(NAME, gqa_fold_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def use_gqa_decode(model) -> bool:
    """Switch a loaded model (a PeftModel too) from sdpa to NAME. False, and nothing changed, when
    its attention has as many KV heads as query heads or it runs on another implementation."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads == heads or base.config._attn_implementation not in ("sdpa", NAME):
        return False
    base.set_attn_implementation(register())
    return True
