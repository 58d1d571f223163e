"""numasched.models: a tensor-parallel Llama / Qwen3-style decoder on numasched's ops.

    from numasched.models import TPDecoder, NumaschedBackend, TorchBackend, DecodeRunner
    model = TPDecoder.from_hf(hf_model)                      # or TPDecoder.random(config, ...)
    backend = NumaschedBackend()                             # TorchBackend(): the baseline
    cache = backend.new_cache(model, batch=1, capacity=256)
    logits = model.prefill(ids, cache, backend)
    step = DecodeRunner(model, backend, cache)               # one CUDA graph per decode step
    logits = step(next_ids)

See docs/models.md. Transformers is needed only by ``TPDecoder.from_hf`` (a model you pass in).
"""
from .backends import BACKENDS, Backend, NumaschedBackend, TorchBackend  # noqa: F401
from .kv_cache import ContiguousKVCache, PagedKVCache  # noqa: F401
from .llama import (PRESETS, DecoderSpec, LayerWeights, TPDecoder, preset_config, rope_inv_freq,  # noqa: F401
                    spec_from_config)
from .runner import DecodeRunner  # noqa: F401

__all__ = ["TPDecoder", "DecoderSpec", "LayerWeights", "spec_from_config", "preset_config", "PRESETS",
           "rope_inv_freq", "Backend", "NumaschedBackend", "TorchBackend", "BACKENDS", "PagedKVCache",
           "ContiguousKVCache", "DecodeRunner"]
