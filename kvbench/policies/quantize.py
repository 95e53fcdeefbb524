"""Quantised KV storage: per-token absmax scaling to int8 or fp8 (e4m3).

Every stored entry (one token of one KV head, a vector of ``head_dim`` numbers) gets its own float32 scale
s = max|x| / qmax and is stored as x / s in the low-precision type: int8 (round to nearest, qmax = 127) or
``torch.float8_e4m3fn`` (round to nearest even, qmax = 448). The cache holds only the quantised tensors and
the scales, and its resident bytes count exactly those; attention runs on the dequantised values
(x̂ = q · s), which is what a quantised KV cache without fused low-precision kernels computes.

Error bounds per element: int8 |x - x̂| <= s / 2; fp8 e4m3 (3 mantissa bits) |x - x̂| <= max(|x| · 2⁻⁴, s · 2⁻¹⁰)
(relative half-ulp for normal numbers, half the subnormal spacing 2⁻⁹ below 2⁻⁶).
fp8 bytes are kept in uint8 tensors (bit-identical views), since not every torch op moves float8 tensors.
"""

from __future__ import annotations

import torch

from kvbench.registry import Registry


class Quantizer:
    qmax: float = 1.0
    storage_dtype: torch.dtype = torch.int8

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (codes [..., D] in ``storage_dtype``, scales [..., 1] float32)."""
        xf = x.to(torch.float32)
        scale = xf.abs().amax(dim=-1, keepdim=True) / self.qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return self.encode(xf / safe), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.decode(codes) * scale).to(dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on |x - dequantize(quantize(x))|."""
        raise NotImplementedError


QUANTIZERS: Registry[type[Quantizer]] = Registry("quantiser", ("kvbench.policies.quantize",), Quantizer)


@QUANTIZERS.register("int8")
class Int8(Quantizer):
    qmax = 127.0
    storage_dtype = torch.int8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.round().clamp_(-127, 127).to(torch.int8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.float32)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.to(torch.float32).abs().amax(dim=-1, keepdim=True) / self.qmax
        return (scale / 2).expand_as(x) * (1 + 1e-5)


@QUANTIZERS.register("fp8")
class Fp8(Quantizer):
    qmax = 448.0
    storage_dtype = torch.uint8

    def __init__(self) -> None:
        dtype = getattr(torch, "float8_e4m3fn", None)
        if dtype is None:
            raise ValueError(
                f"quantize=fp8 needs torch.float8_e4m3fn (torch >= 2.1); this torch is {torch.__version__}"
            )
        try:
            torch.zeros(2).to(dtype).view(torch.uint8).view(dtype).to(torch.float32)
        except (RuntimeError, TypeError) as err:  # pragma: no cover - depends on the build
            raise ValueError(f"quantize=fp8 is not supported by this torch build: {err}") from err
        self.fp8 = dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-self.qmax, self.qmax).to(self.fp8).view(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(self.fp8).to(torch.float32)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        scale = xf.abs().amax(dim=-1, keepdim=True) / self.qmax
        return torch.maximum(xf.abs() * 2.0**-4, (scale * 2.0**-10).expand_as(xf)) * (1 + 1e-5) + 1e-12


def build_quantizer(spec: str | None) -> Quantizer | None:
    """``none`` (or nothing): entries are stored as they are."""
    if spec in (None, "none", False, "null"):
        return None
    if spec not in QUANTIZERS:
        raise ValueError(f"unknown quantize {spec!r}; choose one of none, {QUANTIZERS.choices()}")
    return QUANTIZERS.get(spec)()
