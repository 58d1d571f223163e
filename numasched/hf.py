"""Hugging Face transformers integration: ``attn_implementation="numasched"``.

    import numasched.hf
    numasched.hf.register()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="numasched")
    # or, on a model already built: model.set_attn_implementation("numasched")

Prefill runs numasched's Triton attention kernel, cached decoding (one new token) runs Flash
Decode, and a cached step with 2 to 16 new tokens (assisted / speculative decoding's verification,
a short chunk) runs multi-token Flash Decode over HF's (B, HK, L, D) cache as is, through
numasched's SDPA routing; what they do not support (a padding mask, dropout in training, ...)
runs torch's SDPA as HF's "sdpa" path would. Longer chunks against a cache run the attention
kernel with the bottom-right diagonal.

Masks: HF builds masks per attention implementation. :func:`register` registers HF's own SDPA
mask builder under our name too, so HF hands us ``None`` whenever the mask is purely causal in
torch's top-left sense (its "is_causal skip"), exactly as it does for "sdpa"; then ``is_causal``
drives the kernel. A boolean mask that turns out to be a plain causal mask (bottom-right aligned,
as with a KV cache and several new tokens) is recognised too and runs the kernel with that
diagonal; any other mask falls back to torch.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import _sdpa

NAME = "numasched"
__all__ = ["NAME", "register", "attention"]


def _causal_offset_of(mask: torch.Tensor, Lq: int, Lk: int) -> Optional[int]:
    """``Lk - Lq`` if the boolean mask is the bottom-right causal mask for every batch and head, else None.

    Reads the mask (a device sync), so it is skipped under torch.compile and CUDA graph capture.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (Lq, Lk):
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    off = Lk - Lq
    i = torch.arange(Lq, device=mask.device)[:, None]
    j = torch.arange(Lk, device=mask.device)[None, :]
    want = (j <= i + off).expand_as(mask)
    return off if bool(torch.equal(mask, want)) else None


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
              is_causal: Optional[bool] = None, **kwargs):
    """HF attention-interface function: query (B, H, Lq, D), key/value (B, HK, Lk, D).

    Returns ``(out, None)`` with out (B, Lq, H, D), as HF's "sdpa" function does.
    """
    B, H, Lq, D = query.shape
    Hk, Lk = key.shape[1], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    gqa = H != Hk
    if attention_mask is None:
        # HF skipped the mask: causal in torch's top-left sense when there are several queries
        # (q_len == kv_len, or prefill into an empty static cache), none for a single query
        out = _sdpa(query, key, value, None, dropout, bool(causal) and Lq > 1, scaling, gqa, "auto")
    else:
        off = _causal_offset_of(attention_mask, Lq, Lk)
        if off is not None:
            out = _sdpa(query, key, value, None, dropout, True, scaling, gqa, "auto",
                        causal_offset=off, mask_for_fallback=attention_mask)
        else:
            out = _sdpa(query, key, value, attention_mask, dropout, False, scaling, gqa, "auto")
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Register the attention (and HF's SDPA mask builder) under ``name``; returns the name.

    Then ``attn_implementation=name`` selects it (``from_pretrained``, ``from_config`` or
    ``model.set_attn_implementation``).
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("numasched.hf needs transformers >= 4.48 (pip install 'numasched[hf]')") from e
    AttentionInterface.register(name, attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers build masks without a per-implementation interface
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name
