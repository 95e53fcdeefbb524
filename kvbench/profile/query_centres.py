"""TriAttention's calibration: a model's per-head query centres before RoPE, measured on a text, saved for
``policy.score.calibration`` (``kvbench.policies.query_centres`` reads it).

    python -m kvbench.profile.query_centres --model smollm2-135m --text FILE --out centres.npz [--tokens 4096]

The model reads the text's first ``--tokens`` tokens in one forward; every attention layer's queries, as the
attention function gets them (RoPE applied), are turned back by the model's own RoPE at their positions and
averaged per query head: the mean query and the mean modulus of each RoPE pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvbench.policies.positions import score_rotaries
from kvbench.policies.query_centres import QueryCentres, describe, pair_moduli

ATTN_NAME = "kvbench_query_centres"


class _Recorder:
    """Sums each layer's pre-RoPE queries and pair moduli, the model attending with its own implementation."""

    def __init__(self, model: Any):
        self.rotaries = score_rotaries(model)
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.implementation = model.config._attn_implementation

    def __call__(self, module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layer = int(module.layer_idx)
        rotary = self.rotaries[layer]
        positions = torch.arange(query.shape[2], device=query.device)
        before = rotary.unrotate(query.float(), positions)  # [1, heads, n, D]
        self.sums[layer] = (before[0].sum(dim=1).double(), pair_moduli(before[0], rotary).sum(dim=1).double())
        if self.implementation in ALL_ATTENTION_FUNCTIONS:
            return ALL_ATTENTION_FUNCTIONS[self.implementation](module, query, *args, **kwargs)
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, *args, **kwargs)


def measure(model: Any, ids: list[int]) -> QueryCentres:
    """The query centres of ``model`` over the token ids ``ids`` (one forward, no cache)."""
    recorder = _Recorder(model)
    AttentionInterface.register(ATTN_NAME, recorder)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    layers = sorted(recorder.sums)
    centre = torch.stack([recorder.sums[i][0] for i in layers]) / len(ids)
    pair_norm = torch.stack([recorder.sums[i][1] for i in layers]) / len(ids)
    return QueryCentres(centre.float().cpu(), pair_norm.float().cpu(), describe(model.config), len(ids))


def main(argv: list[str] | None = None) -> int:
    from kvbench.models import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model kvbench loads (configs/model/*.yaml's name)")
    parser.add_argument("--source", default="embedded")
    parser.add_argument("--text", type=Path, required=True, help="a plain-text file to calibrate on")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(argv)
    lm = load_model(a.model, source=a.source, dtype="float32", device="cpu")
    ids = lm.tokenizer(a.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][: a.tokens]
    measure(lm.model, ids).save(a.out)
    print(f"{a.out}: query centres of {a.model} over {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
