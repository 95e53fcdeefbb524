"""A forward pass for Llama-family models with fused, pre-transposed projections.

On a CPU a decode step is bound by reading the weights once. transformers' modules read seven
separate matrices per layer through ``x @ W.T``; here Q, K and V are one matrix, gate and up are
one, and every matrix is stored as ``[in, out]`` so the product streams it contiguously. The cache,
the attention function and therefore every policy are exactly the ones the model forward uses.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.engine.attention import ATTN_NAME

SUPPORTED_TYPES = ("llama",)


def supports(model: Any) -> tuple[bool, str]:
    """Whether the fused path computes exactly the model's function (else why not)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return False, f"model_type {cfg.model_type!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return False, "projection biases are not fused"
    if cfg.hidden_act != "silu":
        return False, f"activation {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return False, "tensor-parallel pretraining slices are not supported"
    return True, ""


@dataclass
class _Layer:
    attn: Any  # the model's attention module: layer index, GQA groups and scaling for the attention function
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: Any
    norm_post: Any
    split: tuple[int, int, int]


class FusedLlama:
    """Call like the model (input ids, positions, cache) and get each sequence's last logits [B, V]."""

    def __init__(self, model: Any):
        ok, why = supports(model)
        if not ok:
            raise ValueError(f"fused forward unavailable: {why}")
        core = model.model
        self.embed, self.rotary, self.norm = core.embed_tokens, core.rotary_emb, core.norm
        self.lm_head = model.lm_head.weight.detach().t().contiguous()
        self.layers = []
        with torch.no_grad():
            for layer in core.layers:
                a, m = layer.self_attn, layer.mlp
                q, k, v = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
                self.layers.append(
                    _Layer(
                        attn=a,
                        qkv=torch.cat([q, k, v]).t().contiguous(),
                        o=a.o_proj.weight.t().contiguous(),
                        gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).t().contiguous(),
                        down=m.down_proj.weight.t().contiguous(),
                        norm_in=layer.input_layernorm,
                        norm_post=layer.post_attention_layernorm,
                        split=(q.shape[0], k.shape[0], v.shape[0]),
                    )
                )
        self.head_dim = self.layers[0].attn.head_dim
        # MKL's packed GEMM for one batch size (``pack``): on CPU MKL's plain product picks a slow kernel for a few
        # rows at once, the packed one does not (docs/perf/batch.md), at the cost of a packed copy of every weight.
        self.packed_batch = 0
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pack(self, batch: int) -> None:
        """Pack every matrix for products of ``batch`` rows (CPU with MKL only); 0 drops the packed copies."""
        self.packed = {}
        self.packed_batch = 0
        if batch <= 1 or self.lm_head.device.type != "cpu" or not hasattr(torch.ops.mkl, "_mkl_linear"):
            return
        with torch.no_grad():
            for w in self.matrices():
                self.packed[id(w)] = (torch.ops.mkl._mkl_reorder_linear_weight(w.t(), batch), w.t())
        self.packed_batch = batch

    def matrices(self) -> list[torch.Tensor]:
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [B, q, in] @ w [in, out], packed where the batch is the packed one."""
        if self.packed_batch and x.shape[0] * x.shape[1] == self.packed_batch:
            packed, original = self.packed[id(w)]
            out = torch.ops.mkl._mkl_linear(x.reshape(-1, x.shape[-1]), packed, original, None, self.packed_batch)
            return out.view(*x.shape[:-1], -1)
        return x @ w

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        batch, length = input_ids.shape
        attend = ALL_ATTENTION_FUNCTIONS[ATTN_NAME]  # looked up per call, as the model's modules do
        for layer in self.layers:
            x = layer.norm_in(hidden)
            q, k, v = self.product(x, layer.qkv).split(layer.split, dim=-1)
            q = q.view(batch, length, -1, self.head_dim).transpose(1, 2)
            k = k.view(batch, length, -1, self.head_dim).transpose(1, 2)
            v = v.view(batch, length, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, layer.attn.layer_idx)
            out, _ = attend(layer.attn, q, k, v, None, scaling=layer.attn.scaling)
            hidden = hidden + self.product(out.reshape(batch, length, -1), layer.o)
            x = layer.norm_post(hidden)
            gate, up = self.product(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self.product(torch.nn.functional.silu(gate) * up, layer.down)
        return self.product(self.norm(hidden[:, -1:]), self.lm_head)[:, -1]


def fused_forward_for(model: Any, fused: bool | None) -> FusedLlama | None:
    """The model's fused forward, built once and kept on the model; None where it does not apply. By default CPU
    only: an accelerator's kernels take transposed weights as they are, and fused copies would double them."""
    if fused is False or (fused is None and next(model.parameters()).device.type != "cpu"):
        return None
    ok, why = supports(model)
    if not ok:
        if fused:
            raise ValueError(f"fused=true but {why}; use fused=false")
        return None
    key = (next(model.parameters()).device, next(model.parameters()).dtype)
    cached = _BUILT.get(model)
    if cached is None or cached[0] != key:
        cached = _BUILT[model] = (key, FusedLlama(model))
    return cached[1]


# Each model's fused forward, for the device and dtype it was built on; it goes when the model goes (the fused
# forward holds the model's modules, never the model).
_BUILT: weakref.WeakKeyDictionary[Any, tuple[tuple[torch.device, torch.dtype], FusedLlama]] = (
    weakref.WeakKeyDictionary()
)
