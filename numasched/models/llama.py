"""A tensor-parallel Llama / Qwen3-style decoder on numasched's ops (or torch's, as the baseline).

    spec = spec_from_config(config)                       # a transformers LlamaConfig / Qwen3Config (or a dict)
    model = TPDecoder.random(config, dtype=torch.bfloat16, device="cuda", tp_rank=r, tp_size=n)
    model = TPDecoder.from_hf(hf_model, tp_rank=r, tp_size=n) # shard an existing transformers model
    backend = NumaschedBackend(ctx=ctx)                   # or TorchBackend(): the same model code
    cache = backend.new_cache(model, batch=B, capacity=4096)
    logits = model.prefill(prompt_ids, cache, backend)    # (B, vocab) at the last prompt token
    logits = model.decode(next_ids, cache, backend)       # one token per sequence; cache.lens += 1

Megatron sharding over ``tp_size`` ranks: query/key/value heads split over ranks (one fused
column-parallel QKV weight per rank), gate/up column-parallel (one fused weight), o_proj and
down_proj row-parallel (each followed by an all-reduce, fused with the GEMM on numasched),
embedding and norms replicated, lm_head vocab-parallel with an all-gather of the logits (or
replicated: ``head="replicated"``). Weights are kept as (out, in) matrices, transformers' layout;
numasched reads ``W.T`` views without a copy.

Elementwise work (RMSNorm, RoPE, SwiGLU, residual adds) is shared by both backends; on CUDA it is
compiled with ``torch.compile`` (``compile_elementwise``) so that each is one kernel, as in
gpt-fast; on CPU it runs eagerly.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

import torch
import torch.nn.functional as F

from numasched.rope_cache import reference as rope_reference
from numasched.rope_cache import rms_norm

ROPE_TYPES = ("default", "llama3")
FAMILIES = ("llama", "qwen3")


# ----------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class DecoderSpec:
    """The sizes and constants of a decoder, read from a transformers config."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qk_norm: bool
    tie_embeddings: bool
    rope_theta: float
    rope_type: str
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max: int = 8192

    def param_count(self) -> int:
        """Parameters of the full (unsharded) model."""
        D = self.head_dim
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * D + self.heads * D * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + (2 * D if self.qk_norm else 0)
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.layers * (attn + mlp + norms) + self.vocab * self.hidden + head + self.hidden

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError naming what ``tp_size`` does not divide."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
        for name, n in (("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads),
                        ("intermediate_size", self.intermediate)):
            if n % tp_size:
                raise ValueError(f"tp_size {tp_size} must divide the config's {name} ({n}): heads and the MLP "
                                 f"are split evenly over ranks (no KV-head replication)")


def _get(config, name, default=None):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


_MISSING = object()


def _size(config, name, default=_MISSING) -> int:
    """config.<name> as a positive int (a whole number; refused naming the field otherwise)."""
    v = _get(config, name, None)
    if v is None:
        if default is _MISSING:
            raise ValueError(f"config.{name} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or int(v) < 1:
        raise ValueError(f"config.{name} must be a positive whole number, got {v!r}")
    return int(v)


def spec_from_config(config) -> DecoderSpec:
    """A :class:`DecoderSpec` from a transformers ``LlamaConfig`` / ``Qwen3Config`` (or a dict of the
    same fields). Refuses, naming the field, what the model code does not implement: other model
    types, biases, activations other than SiLU, sliding-window layers, RoPE types other than
    "default" and "llama3", partial rotary embeddings."""
    family = _get(config, "model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
    if _get(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.hidden_act {_get(config, 'hidden_act')!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if _get(config, flag, False):
            raise ValueError(f"config.{flag}=True is not supported (the projections have no bias)")
    if _get(config, "use_sliding_window", False) or any(
            t != "full_attention" for t in (_get(config, "layer_types", None) or [])):
        raise ValueError("config: sliding-window layers are not supported (every layer must be full_attention)")
    hidden, heads = _size(config, "hidden_size"), _size(config, "num_attention_heads")
    kv_heads = _size(config, "num_key_value_heads", heads)
    head_dim = _size(config, "head_dim", None) or hidden // heads
    if head_dim < 1:
        raise ValueError(f"config.hidden_size ({hidden}) // num_attention_heads ({heads}) is 0: no head_dim")
    if heads % kv_heads:
        raise ValueError(f"config.num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        raise ValueError(f"config.head_dim ({head_dim}) must be even (RoPE rotates halves)")
    rope = _get(config, "rope_parameters", None)
    if rope is None:   # transformers < 5: rope_theta + rope_scaling
        rope = dict(_get(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", _get(config, "rope_theta", 10000.0))
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if float(rope.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0) or 1.0)) != 1.0:
        raise ValueError("config.partial_rotary_factor != 1 is not supported")
    extra = {}
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in rope]
        if missing:
            raise ValueError(f"config rope type 'llama3' needs {', '.join(missing)} in its rope parameters")
        extra = dict(rope_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                     rope_high_freq_factor=float(rope["high_freq_factor"]),
                     rope_original_max=int(rope["original_max_position_embeddings"]))
    return DecoderSpec(family=family, vocab=_size(config, "vocab_size"), hidden=hidden,
                       layers=_size(config, "num_hidden_layers"), heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, intermediate=_size(config, "intermediate_size"),
                       eps=float(_get(config, "rms_norm_eps", 1e-6)), qk_norm=family == "qwen3",
                       tie_embeddings=bool(_get(config, "tie_word_embeddings", False)),
                       rope_theta=float(rope.get("rope_theta", 10000.0)), rope_type=rope_type, **extra)


# Public configs (transformers' field names), for benchmarks without a download.
PRESETS: Dict[str, dict] = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                      hidden_act="silu", attention_bias=False, mlp_bias=False,
                      rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
                     hidden_act="silu", attention_bias=False,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # 64 query heads over 8 K/V heads: TP 8 leaves one K/V head per rank
    "qwen3-32b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
                      hidden_act="silu", attention_bias=False,
                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}


def preset_config(name: str, *, layers: Optional[int] = None) -> dict:
    """A copy of ``PRESETS[name]`` (optionally with fewer layers), usable wherever a config is."""
    if name not in PRESETS:
        raise ValueError(f"model {name!r} is not a preset (presets: {', '.join(PRESETS)})")
    cfg = dict(PRESETS[name])
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
        cfg["num_hidden_layers"] = layers
    return cfg


def rope_inv_freq(spec: DecoderSpec) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) fp32, as transformers computes them ("default", "llama3")."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_type == "llama3":
        factor, lo, hi, old = (spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor,
                               spec.rope_original_max)
        low_wl, high_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


# ----------------------------------------------------------------------------- elementwise (shared)
def add_rms_norm(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float):
    """(h + y, rms_norm(h + y)): the residual add and the next norm, one kernel when compiled."""
    h = h + y
    return h, rms_norm(h, w, eps)


def qkv_rope(qkv, cos, sin, hq: int, hk: int, d: int, q_w: Optional[torch.Tensor], k_w: Optional[torch.Tensor],
             eps: float):
    """Split the fused QKV output (T, (hq + 2 hk) d), apply Qwen3's per-head q/k norms when given,
    rotate q and k (cos/sin (T, d)); returns contiguous q (T, hq, d), k and v (T, hk, d): the torch
    math of numasched.qkv_rope_cache (one kernel with the cache write), compiled on CUDA."""
    return rope_reference(qkv, cos, sin, hq, hk, q_w, k_w, eps)


def silu_mul(gu: torch.Tensor, n: int) -> torch.Tensor:
    """SwiGLU on the fused gate/up output (T, 2n): silu(gate) * up."""
    return F.silu(gu[:, :n]) * gu[:, n:]


def rms_inv(h: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each row of h (T,) in fp32, as RMSNorm computes it: where a norm's weight is
    folded into the next projection (TPDecoder.fold_norms), the projection's consumer scales its
    rows by this instead of the projection reading normalised rows."""
    return torch.rsqrt(h.float().pow(2).mean(-1) + eps)


_ELEMENTWISE = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "qkv_rope": qkv_rope, "silu_mul": silu_mul,
                "rms_inv": rms_inv}
_COMPILED: Dict[str, Callable] = {}


def _guard_key(args) -> tuple:
    """What torch.compile specialises a static compile on: each tensor's shape, strides, dtype and
    device, every other argument's value."""
    return tuple([(a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                  for a in args])   # a list first: 1.8 us against 2.5 for a generator (eager steps call it per op)


class CompiledElementwise:
    """One elementwise op under torch.compile (fullgraph): a static kernel per decode-size input
    (at most ``static_rows`` rows, the first ``static_shapes`` distinct inputs: the batch sizes a
    server captures graphs for), one dynamic-shape kernel for the rest. A static compile per
    prefill length would reach dynamo's recompile limit, which fullgraph turns into an error (it
    did at TP 4: the overlapped and sequence-parallel prefills' row counts). Only the rows are
    dynamic there (dim 0 of the row-shaped tensors, marked per call): with every size symbolic
    (``dynamic=True``) the hidden and head sizes became runtime values too, and the prefill's
    elementwise work took 2.6x as long (Llama-3-8B, 4096 tokens, TP 2 on two H200s: 15.2 against
    5.8 ms, both backends; TP 1 on an H100: 26.8 against 10.4 ms, the step 116.9 against 104.6).
    ``backend`` is torch.compile's ("eager" in CPU tests)."""

    def __init__(self, fn: Callable, *, static_rows: int = 256, static_shapes: int = 16, backend: str = "inductor"):
        self.static_rows, self.static_shapes = static_rows, static_shapes
        self.static = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)
        # its own code object: dynamo keeps compiled code (and counts recompiles) per code object
        code = fn.__code__.replace(co_name=fn.__name__ + "_dynamic")
        twin = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        self._dynamic = torch.compile(twin, dynamic=False, fullgraph=True, backend=backend)
        self.keys: set = set()
        self.dynamic_keys: set = set()

    def dynamic(self, *args):
        """The one compile for any row count: dim 0 of the 2-D+ tensors with the first argument's
        rows is marked dynamic (on fresh aliases: the caller's tensors keep no mark that a later
        static compile would see), every other size stays a constant."""
        # (a 1-D argument of ``rows`` elements is not marked: it would compile per length; the
        # elementwise ops here take per-row data only as 2-D+ tensors)
        rows = args[0].shape[0]
        row_shaped = [isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == rows for a in args]
        if rows >= 2:   # 0 and 1 are specialised by dynamo whatever the mark
            args = tuple(a[:] if r else a for a, r in zip(args, row_shaped))
            for a, r in zip(args, row_shaped):
                if r:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        # each new set of widths (another model, another TP size; rows 0 and 1, which dynamo
        # specialises) is a recompile of the one function: lift dynamo's limit for those calls
        # only (the patch costs ~17 us a call). A row-shaped tensor's key leaves out what varies
        # with the rows (its first size and its strides, which a transposed view scales by them)
        key = (min(rows, 2),) + tuple([
            ((a.shape[1:], a.is_contiguous(), a.dtype, a.device) if r else (a.shape, a.stride(), a.dtype, a.device))
            if isinstance(a, torch.Tensor) else (type(a), a) for a, r in zip(args, row_shaped)])
        if key in self.dynamic_keys:
            return self._dynamic(*args)
        self.dynamic_keys.add(key)
        limit = max(torch._dynamo.config.recompile_limit, len(self.dynamic_keys) + 8)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return self._dynamic(*args)

    def __call__(self, *args):
        if args[0].shape[0] > self.static_rows:
            return self.dynamic(*args)
        key = _guard_key(args)
        if key in self.keys:
            return self.static(*args)
        if len(self.keys) >= self.static_shapes:
            return self.dynamic(*args)
        self.keys.add(key)
        limit = max(torch._dynamo.config.recompile_limit, self.static_shapes + 4)
        with torch._dynamo.config.patch(recompile_limit=limit):   # only the call that compiles pays for it
            return self.static(*args)


def _elementwise(name: str, compiled: bool) -> Callable:
    if not compiled:
        return _ELEMENTWISE[name]
    if name not in _COMPILED:
        _COMPILED[name] = CompiledElementwise(_ELEMENTWISE[name])
    return _COMPILED[name]


# ----------------------------------------------------------------------------- weights
@dataclass
class LayerWeights:
    """One layer's local shards (out, in) and its replicated norm weights."""

    wqkv: torch.Tensor    # ((hq + 2 hk) * d, hidden): this rank's q heads, then k heads, then v heads
    wo: torch.Tensor      # (hidden, hq * d): the matching input columns of o_proj
    wgu: torch.Tensor     # (2 * i_local, hidden): this rank's gate rows, then up rows
    wdown: torch.Tensor   # (hidden, i_local)
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None


def _hf_names(i: int) -> dict:
    p = f"model.layers.{i}."
    return dict(q=p + "self_attn.q_proj.weight", k=p + "self_attn.k_proj.weight", v=p + "self_attn.v_proj.weight",
                o=p + "self_attn.o_proj.weight", gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight",
                down=p + "mlp.down_proj.weight", ln1=p + "input_layernorm.weight",
                ln2=p + "post_attention_layernorm.weight", q_norm=p + "self_attn.q_norm.weight",
                k_norm=p + "self_attn.k_norm.weight")


def _full_shapes(spec: DecoderSpec) -> Dict[str, tuple]:
    """transformers' parameter name -> shape, in a fixed order (the random weights' seed order)."""
    H, HK, D, E, I = spec.heads, spec.kv_heads, spec.head_dim, spec.hidden, spec.intermediate
    shapes = {"model.embed_tokens.weight": (spec.vocab, E)}
    for i in range(spec.layers):
        n = _hf_names(i)
        shapes.update({n["q"]: (H * D, E), n["k"]: (HK * D, E), n["v"]: (HK * D, E), n["o"]: (E, H * D),
                       n["gate"]: (I, E), n["up"]: (I, E), n["down"]: (E, I), n["ln1"]: (E,), n["ln2"]: (E,)})
        if spec.qk_norm:
            shapes.update({n["q_norm"]: (D,), n["k_norm"]: (D,)})
    shapes["model.norm.weight"] = (E,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab, E)
    return shapes


class TPDecoder:
    """One rank's shard of a Llama / Qwen3 decoder (see the module doc); stateless between calls
    (the KV cache and the backend are arguments)."""

    def __init__(self, spec: DecoderSpec, layers: List[LayerWeights], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, *, tp_rank: int, tp_size: int, head: str,
                 compile_elementwise: Optional[bool] = None):
        self.spec, self.layers, self.embed, self.norm, self.lm_head = spec, layers, embed, norm, lm_head
        self.tp_rank, self.tp_size, self.head = tp_rank, tp_size, head
        self.dtype, self.device = embed.dtype, embed.device
        self.heads_local = spec.heads // tp_size
        self.kv_heads_local = spec.kv_heads // tp_size
        self.inter_local = spec.intermediate // tp_size
        if compile_elementwise is None:
            compile_elementwise = self.device.type == "cuda"
        self.compile_elementwise = bool(compile_elementwise)
        self._inv_freq = rope_inv_freq(spec).to(self.device)
        self._rope = torch.empty(0, 2, spec.head_dim, dtype=self.dtype, device=self.device)
        self.norms_folded = False

    # -- construction
    @classmethod
    def from_weights(cls, spec: DecoderSpec, get: Callable[[str, tuple], torch.Tensor], *, tp_rank: int = 0,
                     tp_size: int = 1, dtype=None, device=None, head: Optional[str] = None,
                     compile_elementwise: Optional[bool] = None) -> "TPDecoder":
        """Shard full weights given by ``get(transformers name, shape)`` (called once per weight, in
        :func:`_full_shapes` order; each full tensor may be dropped once sliced)."""
        spec.check_tp(tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be an integer in [0, tp_size={tp_size}), got {tp_rank!r}")
        head = head or ("vocab_parallel" if tp_size > 1 else "replicated")
        if head not in ("vocab_parallel", "replicated"):
            raise ValueError(f"head must be 'vocab_parallel' or 'replicated', got {head!r}")
        if head == "vocab_parallel" and spec.vocab % tp_size:
            raise ValueError(f"head='vocab_parallel' needs tp_size {tp_size} to divide vocab_size {spec.vocab}; "
                             f"pass head='replicated'")
        r, n = tp_rank, tp_size
        D = spec.head_dim
        hq, hk, il = spec.heads // n, spec.kv_heads // n, spec.intermediate // n
        shapes = _full_shapes(spec)

        def fetch(name):
            t = get(name, shapes[name])
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
            return t

        def own(t):   # a local copy in the target dtype/device, not a view of the full tensor
            return t.to(device=device, dtype=dtype).contiguous().clone()

        rows = lambda t, k: t[r * k:(r + 1) * k]        # noqa: E731  column-parallel: output rows
        cols = lambda t, k: t[:, r * k:(r + 1) * k]     # noqa: E731  row-parallel: input columns
        embed_full = fetch("model.embed_tokens.weight")
        embed = own(embed_full)
        layers = []
        for i in range(spec.layers):
            nm = _hf_names(i)
            q, k, v = (fetch(nm[x]) for x in ("q", "k", "v"))
            wqkv = own(torch.cat([rows(q, hq * D).to(device=device), rows(k, hk * D).to(device=device),
                                  rows(v, hk * D).to(device=device)]))
            del q, k, v
            wo = own(cols(fetch(nm["o"]), hq * D))
            g, u = fetch(nm["gate"]), fetch(nm["up"])
            wgu = own(torch.cat([rows(g, il).to(device=device), rows(u, il).to(device=device)]))
            del g, u
            wdown = own(cols(fetch(nm["down"]), il))
            ln1, ln2 = own(fetch(nm["ln1"])), own(fetch(nm["ln2"]))
            qn = kn = None
            if spec.qk_norm:
                qn, kn = own(fetch(nm["q_norm"])), own(fetch(nm["k_norm"]))
            layers.append(LayerWeights(wqkv, wo, wgu, wdown, ln1, ln2, qn, kn))
        norm = own(fetch("model.norm.weight"))
        head_full = embed_full if spec.tie_embeddings else fetch("lm_head.weight")
        vl = spec.vocab // n
        lm_head = own(head_full[r * vl:(r + 1) * vl] if head == "vocab_parallel" else head_full)
        del embed_full, head_full
        return cls(spec, layers, embed, norm, lm_head, tp_rank=r, tp_size=n, head=head,
                   compile_elementwise=compile_elementwise)

    @classmethod
    def from_hf(cls, model, tp_rank: int = 0, tp_size: int = 1, *, dtype=None, device=None,
                head: Optional[str] = None, compile_elementwise: Optional[bool] = None) -> "TPDecoder":
        """This rank's shard of a transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (same
        dtype and device as the model unless given)."""
        if not hasattr(model, "config") or not hasattr(model, "named_parameters"):
            raise TypeError(f"model must be a transformers LlamaForCausalLM / Qwen3ForCausalLM (a module with a "
                            f".config), got {type(model).__name__}")
        spec = spec_from_config(model.config)
        params = dict(model.named_parameters())
        if spec.tie_embeddings:
            params.setdefault("lm_head.weight", params["model.embed_tokens.weight"])
        first = params["model.embed_tokens.weight"]
        dtype = dtype or first.dtype
        device = torch.device(device) if device is not None else first.device

        def get(name, shape):
            if name not in params:
                raise ValueError(f"model has no parameter {name!r} (is it a Llama/Qwen3 causal LM?)")
            return params[name].detach()

        with torch.no_grad():
            return cls.from_weights(spec, get, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device,
                                    head=head, compile_elementwise=compile_elementwise)

    @classmethod
    def random(cls, config, *, dtype=torch.bfloat16, device="cuda", tp_rank: int = 0, tp_size: int = 1,
               seed: int = 0, std: Optional[float] = None, head: Optional[str] = None,
               compile_elementwise: Optional[bool] = None) -> "TPDecoder":
        """Random weights, the same on every rank (each full weight is drawn on ``device`` from a
        generator seeded by ``seed`` and the weight's index, then sliced: one full weight at a time
        is materialised, never the whole model). Linear weights and the embedding ~ N(0, std)
        (default config.initializer_range or 0.02), norm weights 1 (transformers' init)."""
        spec = spec_from_config(config)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        std = float(std if std is not None else (_get(config, "initializer_range", None) or 0.02))
        device = torch.device(device)
        order = {name: i for i, name in enumerate(_full_shapes(spec))}

        def get(name, shape):
            if len(shape) == 1:
                return torch.ones(shape, dtype=dtype, device=device)
            g = torch.Generator(device=device)
            g.manual_seed(int(seed) * 1_000_003 + order[name])
            return torch.randn(shape, generator=g, dtype=dtype, device=device).mul_(std)

        with torch.no_grad():
            return cls.from_weights(spec, get, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device,
                                    head=head, compile_elementwise=compile_elementwise)

    @torch.no_grad()
    def fold_norms(self) -> "TPDecoder":
        """Fold each layer's two RMSNorm weights into the projection that reads the norm's output
        (in place): ``wqkv[:, j] *= ln1[j]``, ``wgu[:, j] *= ln2[j]``, and the norms' weights
        become ones. The model computes the same function (up to the rounding of the products to
        the weights' dtype); a backend may then skip writing the normalised rows of a prefill
        and scale the projections' outputs by each row's 1 / rms instead (``Backend.norm_free``:
        numasched's SwiGLU GEMM and RoPE kernels take the factors). The final norm (before the
        LM head) keeps its weight. Returns the model; a second call does nothing."""
        if self.norms_folded:
            return self
        for L in self.layers:
            L.wqkv.copy_((L.wqkv.float() * L.ln1.float()[None, :]).to(L.wqkv.dtype))
            L.wgu.copy_((L.wgu.float() * L.ln2.float()[None, :]).to(L.wgu.dtype))
            L.ln1 = torch.ones_like(L.ln1)
            L.ln2 = torch.ones_like(L.ln2)
        self.norms_folded = True
        return self

    def nbytes(self) -> int:
        """Bytes of this rank's weights."""
        ts = [self.embed, self.norm, self.lm_head]
        for L in self.layers:
            ts += [t for t in (L.wqkv, L.wo, L.wgu, L.wdown, L.ln1, L.ln2, L.q_norm, L.k_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    # -- running
    def _ew(self, name: str) -> Callable:
        return _elementwise(name, self.compile_elementwise)

    def _layer_ops(self) -> tuple:
        """A layer's elementwise kernels: RMSNorm, residual add + RMSNorm, QKV split + RoPE, SwiGLU."""
        return tuple(self._ew(n) for n in ("rms_norm", "add_rms_norm", "qkv_rope", "silu_mul"))

    def rope_table(self, n: int) -> torch.Tensor:
        """(n, 2, head_dim) cos/sin for positions 0..n-1 in the model dtype (grown on demand; call
        with the cache capacity before capturing a graph)."""
        if self._rope.shape[0] < n:
            pos = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), -1)
            self._rope = torch.stack((emb.cos(), emb.sin()), 1).to(self.dtype)
        return self._rope

    def _check_backend(self, backend, cache) -> None:
        if backend.tp_size != self.tp_size:
            raise ValueError(f"backend has tp_size {backend.tp_size} but the model was sharded for {self.tp_size}")
        if not isinstance(cache, backend.cache_class):
            raise TypeError(f"cache is a {type(cache).__name__}; the {backend.name} backend reads a "
                            f"{backend.cache_class.__name__} (backend.new_cache(model, ...))")
        want = dict(layers=self.spec.layers, kv_heads=self.kv_heads_local, head_dim=self.spec.head_dim,
                    dtype=self.dtype)
        have = {k: getattr(cache, k, None) for k in want}
        if have != want:
            raise ValueError(f"cache was made for another model: it has {have}, this model (this rank's shard) needs "
                             f"{want} (backend.new_cache(model, ...))")

    @staticmethod
    def _check_ids(ids, shape: tuple) -> None:
        """Token ids: an int32 / int64 tensor of ``shape`` (host metadata only: graph-safe)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) \
                or tuple(ids.shape) != tuple(shape):
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must be an int32 / int64 tensor of shape {tuple(shape)}, got {got}")

    def _stack(self, ids: torch.Tensor, cs: torch.Tensor, cache, backend, batch: int, seq: Optional[int],
               last_only: bool = False):
        """Every layer on token ids (T,) with cos/sin (T, 2, D); seq None: one decode token per
        sequence. Returns the final-normed hidden states (T, hidden), or with ``last_only`` (a
        prefill) those of each sequence's last token (batch, hidden)."""
        if seq is not None and (chunks := backend.prefill_chunks(batch, seq)) > 1:
            x = self._stack_overlapped(ids, cs, cache, backend, chunks)
        elif seq is not None and backend.seq_parallel(batch, seq):
            return self._stack_seq_parallel(ids, cs, cache, backend, batch, seq, last_only)
        else:
            x = self._stack_bulk(ids, cs, cache, backend, batch, seq)
        return x.view(batch, seq, -1)[:, -1] if last_only else x

    def _stack_bulk(self, ids: torch.Tensor, cs: torch.Tensor, cache, backend, batch: int, seq: Optional[int]):
        """Every layer on all T rows, each row-parallel projection all-reduced (bulk-synchronous)."""
        s, hq, hk, D = self.spec, self.heads_local, self.kv_heads_local, self.spec.head_dim
        norm, add_norm, qkv_rope_, swiglu = self._layer_ops()
        cos, sin = cs[:, 0], cs[:, 1]
        L0 = self.layers[0]
        h = backend.residual_stream(F.embedding(ids, self.embed), (L0.wo, L0.wdown))
        # norm-free (a prefill of a model with folded norms, where the backend asks for it): the
        # projections read the residual stream itself and their consumers scale each row by the
        # norm's 1 / rms (r): the normalised rows never go to memory
        free = seq is not None and self.norms_folded and backend.norm_free(h.shape[0])
        inv = self._ew("rms_inv") if free else None
        x, r = (h, inv(h, s.eps)) if free else (norm(h, L0.ln1, s.eps), None)
        for i, L in enumerate(self.layers):
            qkv = backend.linear(x, L.wqkv)
            if seq is None:   # rotate, write the cache (one launch where the backend fuses them), attend
                q = backend.rope_cache_write(qkv, cos, sin, hq, hk, D, L.q_norm, L.k_norm, s.eps, cache, i, qkv_rope_)
                a = backend.decode_attention(q, cache, i)
            else:
                q, k, v = backend.prefill_rope_cache(qkv, cos, sin, hq, hk, D, L.q_norm, L.k_norm, s.eps, cache, i,
                                                     qkv_rope_, row_scale=r)
                a = backend.prefill_attention(q, k, v, batch, seq)
            last = i + 1 == len(self.layers)
            if free:
                h = backend.row_parallel_residual(a, L.wo, h)
                x, r = h, inv(h, s.eps)
                h = backend.row_parallel_residual(backend.linear_swiglu(x, L.wgu, self.inter_local, swiglu,
                                                                        row_scale=r), L.wdown, h)
                x, r = (norm(h, self.norm, s.eps), None) if last else (h, inv(h, s.eps))
                continue
            # a decode step of a model with folded norms: the norms' weights are ones (the last
            # layer's final norm keeps its weight), which a backend may leave to the projections
            unit = seq is None and self.norms_folded
            h, x = backend.row_parallel_add_norm(a, L.wo, h, L.ln2, s.eps, add_norm, norm, unit_norm=unit)
            nxt = self.norm if last else self.layers[i + 1].ln1
            h, x = backend.row_parallel_add_norm(backend.linear_swiglu(x, L.wgu, self.inter_local, swiglu), L.wdown,
                                                 h, nxt, s.eps, add_norm, norm, unit_norm=unit and not last)
        return x

    def _stack_seq_parallel(self, ids: torch.Tensor, cs: torch.Tensor, cache, backend, batch: int, seq: int,
                            last_only: bool):
        """The prefill sequence-parallel (Megatron style): this rank keeps rows [r T / tp, (r + 1)
        T / tp) of the residual stream and normalises only those; a column-parallel projection
        all-gathers its input rows (``backend.all_gather_linear``), a row-parallel one
        reduce-scatters its output rows (``backend.linear_reduce_scatter``); RoPE, the cache
        write and attention see all T rows of this rank's heads. The bytes moved equal the
        all-reduces' (an all-reduce is a reduce-scatter and an all-gather); the norms, residual
        adds and their memory traffic are 1/tp per rank. Returns all T final-normed rows
        (gathered), or with ``last_only`` each sequence's last row: every rank puts the ones it
        holds into a zero (batch, hidden) block and one small all-reduce assembles them (exact:
        one non-zero term per element)."""
        if backend.group_rank() != self.tp_rank:   # rows are kept by our rank, gathered by the group's
            raise ValueError(f"the model holds shard {self.tp_rank} but this process is rank "
                             f"{backend.group_rank()} of the backend's TP group: the sequence-parallel prefill "
                             f"needs them equal")
        s, hq, hk, D = self.spec, self.heads_local, self.kv_heads_local, self.spec.head_dim
        norm, add_norm, qkv_rope_, swiglu = self._layer_ops()
        cos, sin = cs[:, 0], cs[:, 1]
        T = ids.shape[0]
        rows = T // self.tp_size
        mine = slice(self.tp_rank * rows, (self.tp_rank + 1) * rows)
        h = F.embedding(ids[mine], self.embed)
        x = norm(h, self.layers[0].ln1, s.eps)
        for i, L in enumerate(self.layers):
            qkv = backend.all_gather_linear(x, L.wqkv)
            q, k, v = qkv_rope_(qkv, cos, sin, hq, hk, D, L.q_norm, L.k_norm, s.eps)
            cache.write(i, k, v)
            a = backend.prefill_attention(q, k, v, batch, seq)
            h, x = add_norm(backend.linear_reduce_scatter(a, L.wo), h, L.ln2, s.eps)
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm
            g = swiglu(backend.all_gather_linear(x, L.wgu), self.inter_local)
            h, x = add_norm(backend.linear_reduce_scatter(g, L.wdown), h, nxt, s.eps)
        if not last_only:
            return backend.all_gather_rows(x)
        # sequence b ends at row b * seq + seq - 1; ours are [start, start + rows): the sequences
        # b0 <= b < b1, every seq-th of our rows (a strided slice: no index tensor, graph-safe)
        last = torch.zeros(batch, x.shape[1], device=x.device, dtype=x.dtype)
        b0 = max(0, -(-(mine.start - seq + 1) // seq))
        b1 = min(batch, -(-(mine.stop - seq + 1) // seq))
        if b1 > b0:
            first = b0 * seq + seq - 1 - mine.start
            last[b0:b1] = x[first::seq][:b1 - b0]
        return backend.all_reduce(last)

    def _stack_overlapped(self, ids: torch.Tensor, cs: torch.Tensor, cache, backend, chunks: int) -> torch.Tensor:
        """:meth:`_stack` for the prefill of one prompt in ``chunks`` row blocks that overlap their
        all-reduces with each other's compute (``backend.prefill_chunks``).

        Chunk c's layers run on stream c (chunk 0 on the caller's stream), every all-reduce on one
        high-priority communication stream, in the order the loop issues them (so the ranks'
        collectives stay in one order and never run two at a time on one context): while chunk 0's
        o_proj sum crosses the link, chunk 1 computes its attention, and so on. Chunk c attends
        to the keys of chunks 0..c (causal, bottom-right aligned), which the other streams wrote into a
        ring of two per-layer K/V buffers; events order every hand-over. On CPU the same order runs
        on one stream. Returns the final-normed hidden states (T, hidden), as :meth:`_stack`."""
        import contextlib

        s, hq, hk, D = self.spec, self.heads_local, self.kv_heads_local, self.spec.head_dim
        norm, add_norm, qkv_rope_, swiglu = self._layer_ops()
        T = ids.shape[0]
        step = -(-T // chunks)
        bounds = [(a, min(step, T - a)) for a in range(0, T, step)]
        n = len(bounds)
        cuda = ids.is_cuda
        if cuda:
            main = torch.cuda.current_stream(ids.device)
            side, comm = _overlap_streams(ids.device, n - 1, main)
            streams = [main] + side
            for st in streams[1:] + [comm]:
                st.wait_stream(main)
            on = torch.cuda.stream
            event = lambda st: st.record_event()  # noqa: E731
            wait = lambda st, ev: st.wait_event(ev)  # noqa: E731
        else:
            streams, comm = [None] * n, None
            on = lambda st: contextlib.nullcontext()  # noqa: E731
            event = lambda st: None  # noqa: E731
            wait = lambda st, ev: None  # noqa: E731
        # made on the caller's stream before the fork, freed after the join: safe on every stream
        y = [torch.empty(rows, s.hidden, device=ids.device, dtype=self.dtype) for _, rows in bounds]
        kbuf = [torch.empty(T, hk, D, device=ids.device, dtype=self.dtype) for _ in range(2)]
        vbuf = [torch.empty(T, hk, D, device=ids.device, dtype=self.dtype) for _ in range(2)]
        kv_ready = [[None] * len(self.layers) for _ in bounds]
        attn_done = [[None] * len(self.layers) for _ in bounds]

        def all_reduce(c):  # chunk c's y[c] on the communication stream, then back
            wait(comm, event(streams[c]))
            with on(comm):
                # in place, no status read: it would block the host mid-prefill (check_peers below)
                backend.all_reduce_overlapped(y[c])
            wait(streams[c], event(comm))

        h, x = [None] * n, [None] * n
        for c, (a, rows) in enumerate(bounds):
            with on(streams[c]):
                h[c] = F.embedding(ids[a:a + rows], self.embed)
                x[c] = norm(h[c], self.layers[0].ln1, s.eps)
        for i, L in enumerate(self.layers):
            ring = i % 2
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm
            for c, (a, rows) in enumerate(bounds):
                st = streams[c]
                with on(st):
                    if i >= 2:   # the ring slot is free once the later chunks read it two layers ago
                        for later in range(c + 1, n):
                            wait(st, attn_done[later][i - 2])
                    qkv = backend.linear(x[c], L.wqkv)
                    q, k, v = qkv_rope_(qkv, cs[a:a + rows, 0], cs[a:a + rows, 1], hq, hk, D, L.q_norm, L.k_norm,
                                        s.eps)
                    cache.write(i, k, v, start=a)
                    kbuf[ring][a:a + rows].copy_(k)
                    vbuf[ring][a:a + rows].copy_(v)
                    kv_ready[c][i] = event(st)
                    for before in range(c):
                        wait(st, kv_ready[before][i])
                    att = backend.prefill_attention_rows(q, kbuf[ring][:a + rows], vbuf[ring][:a + rows])
                    attn_done[c][i] = event(st)
                    backend.linear(att, L.wo, out=y[c])
                    all_reduce(c)
                    h[c], x[c] = add_norm(y[c], h[c], L.ln2, s.eps)
                    backend.linear(backend.linear_swiglu(x[c], L.wgu, self.inter_local, swiglu), L.wdown, out=y[c])
                    all_reduce(c)
                    h[c], x[c] = add_norm(y[c], h[c], nxt, s.eps)
        if cuda:
            for st in streams[1:] + [comm]:
                main.wait_stream(st)
            for xc, st in zip(x[1:], streams[1:]):
                xc.record_stream(main)   # made on another stream, read by the caller's
        backend.check_peers()   # the all-reduces above did not read their status (no host sync mid-step)
        return torch.cat(x)

    def _logits(self, x: torch.Tensor, backend) -> torch.Tensor:
        logits = backend.linear(x, self.lm_head)
        if self.head == "vocab_parallel" and self.tp_size > 1:
            logits = backend.all_gather_last(logits)
        return logits

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache, backend, *, all_logits: bool = False) -> torch.Tensor:
        """Run the prompts ``ids`` (batch, seq) int64 into an empty ``cache`` (K/V written, lens = seq).

        Returns the logits (batch, vocab) at the last prompt token, or (batch, seq, vocab) with
        ``all_logits``. Every prompt has the same length (no padding)."""
        self._check_backend(backend, cache)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != cache.batch:
            raise ValueError(f"ids must be (batch={cache.batch}, seq), got shape {tuple(getattr(ids, 'shape', ()))}")
        self._check_ids(ids, tuple(ids.shape))
        B, S = ids.shape
        cache.begin_prefill(S)
        cs = self.rope_table(S)[:S].repeat(B, 1, 1)
        x = self._stack(ids.reshape(-1), cs, cache, backend, B, S, last_only=not all_logits)
        logits = self._logits(x, backend)
        return logits.view(B, S, -1) if all_logits else logits

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, cache, backend, *, advance: bool = True) -> torch.Tensor:
        """One decode step: token ``ids`` (batch,) int64 at position ``cache.lens`` of each sequence;
        returns the logits (batch, vocab). ``advance``: lens += 1 (False: the step can be replayed
        at the same position, for timing). Graph-safe: no host synchronisation, lengths on the
        device; call :meth:`rope_table` with the cache capacity once before capturing."""
        self._check_backend(backend, cache)
        self._check_ids(ids, (cache.batch,))
        cache.begin_decode()
        cs = self.rope_table(cache.capacity).index_select(0, cache.positions)
        x = self._stack(ids, cs, cache, backend, cache.batch, None)
        logits = self._logits(x, backend)
        cache.end_decode(advance)
        return logits


# The overlapped prefill's streams, made once per device (torch.cuda.Stream() draws from a pool
# of 32 per priority: new ones per call would multiply per-stream buffers and could hand back the
# caller's own stream, which would silently serialise the chunks).
_OVERLAP_STREAMS: Dict[tuple, tuple] = {}


def _overlap_streams(device: torch.device, n_side: int, main) -> tuple:
    """``n_side`` side streams and one high-priority communication stream on ``device``, none of
    them ``main``."""
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    side, comm = _OVERLAP_STREAMS.get(key, ([], None))
    # compared by their handles: a CUDA stream compared with None (or another type) through
    # ``!=`` answers False in torch 2.11, which refused every fresh stream on the H200s
    def taken(st) -> bool:
        h = st.cuda_stream
        return h == main.cuda_stream or any(h == x.cuda_stream for x in side) or (comm is not None and
                                                                                    h == comm.cuda_stream)

    def fresh(**kw):
        for _ in range(64):
            st = torch.cuda.Stream(device=device, **kw)
            if not taken(st):
                return st
        raise RuntimeError(f"no CUDA stream on {device} other than the caller's and the prefill's own "
                           f"after 64 tries")

    side = [st for st in side if st.cuda_stream != main.cuda_stream]
    while len(side) < n_side:
        side.append(fresh())
    if comm is None or comm.cuda_stream == main.cuda_stream:
        comm = fresh(priority=-1)   # its blocks are scheduled first (eager launches)
    _OVERLAP_STREAMS[key] = (side, comm)
    return side[:n_side], comm
