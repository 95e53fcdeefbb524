"""kvbench against NVIDIA's kvpress: the kept sets of each method on the same token ids, per layer and KV head.

    python scripts/peer_agreement.py --peer-python PEER/bin/python --data-dir DIR     # docs/peers.md
    python scripts/peer_agreement.py --peer-python PEER/bin/python --data-dir DIR --methods snapkv tova --prompts 1

kvpress runs in an environment of its own (its transformers pin cannot share kvbench's; docs/peers.md says how to
build it): ``--peer-python`` is that environment's Python, which runs scripts/peer_kvpress_side.py. The prompts are
LongBench contexts (``DIR/<subset>.jsonl``, LongBench's field names) of ``--min-tokens`` to ``--max-tokens``
tokens under the embedded SmolLM2's tokenizer; both sides prefill the same ids on the same SmolLM2 weights.
kvbench runs each method's config at stage=prefill with, by default, kvpress's own kept count as a token budget
(``--budget fraction`` gives 1 - ratio instead, which kvbench rounds up where kvpress rounds down). The table,
written to ``--out`` and printed, counts the rows whose kept sets are identical and explains the others
(scripts/peer_compare.py).

A method is one entry of ``METHODS``: the press (and its arguments) and the kvbench config (and its overrides).
A composed press (kvpress's ``ComposedPress``: a token press, then ThinK on the keys it kept) is compared twice, its
kept tokens and its kept key channels, each a row of the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.engine.replay import template_ends
from kvbench.models import LoadedModel, load_model, load_tokenizer
from kvbench.policies.channels import KeyChannels
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.tasks.datasets import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_compare import Agreement, compare, table, unexplained_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEER_SIDE = Path(__file__).resolve().parent / "peer_kvpress_side.py"


@dataclass(frozen=True)
class Method:
    """kvpress's ``press(**kwargs)`` (wrapping ``inner(**inner_kwargs)`` when given) against kvbench's
    configs/policy/<policy>.yaml with ``overrides`` (dotted keys, as on the command line)."""

    press: str
    policy: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    inner: str | None = None
    inner_kwargs: dict[str, Any] = field(default_factory=dict)
    eager: bool = False  # the press reads attention weights (kvpress needs attn_implementation="eager")
    # The press decides its own kept count (SimLayerKV's lazy layers): kvpress gets no compression ratio (its
    # setter refuses one) and kvbench's budget is 1.0, which caps nothing.
    adaptive: bool = False
    # The press prunes key channels, not tokens (ThinK): both sides' kept sets are channels [layers, heads, D], the
    # press takes no compression ratio (its own names the share of channels) and kvbench's budget caps nothing.
    channels: bool = False
    # The press takes the chat template's opening (the ids before a user message's text) to start every prompt
    # and skips that many ids, whatever they are (KVzip): both sides get prompts that start with it.
    chat_header: bool = False
    # The press ranks every layer's entries at once (KVzip): its kept total must be a whole budget per row.
    pooled: bool = False
    # kvpress's ComposedPress: these presses in order, each on what the one before kept (``press`` unused). Each
    # part takes the compression ratio as it would alone; the kept sets compared are those of every part's kind.
    parts: tuple[Method, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """What the two sides' kept sets are: ``tokens`` [layers, heads, n] and/or ``channels`` [layers, heads, D]."""
        if self.parts:
            return tuple(kind for part in self.parts for kind in part.kinds)
        return ("channels",) if self.channels else ("tokens",)

    # The prompt's last ``question`` tokens are its question (Finch): kvbench gets them as the suffix, kvpress after
    # its delimiter token.
    question: int = 0

    def press_spec(self) -> dict[str, Any]:
        if self.parts:
            presses = [part.press_spec() for part in self.parts]
            eager = any(part.eager for part in self.parts)
            return {"press": "ComposedPress", "presses": presses, "eager": eager, "ratio": False, "channels": False}
        inner = {"press": self.inner, "kwargs": self.inner_kwargs} if self.inner else None
        return {
            "press": self.press,
            "kwargs": self.kwargs,
            "inner": inner,
            "eager": self.eager,
            "ratio": not (self.adaptive or self.channels),
            "channels": self.channels,
            "question": self.question,
        }

    def budget(self, n: int, ratio: float, kind: str) -> float | int:
        """kvbench's budget for a prompt of ``n`` tokens (``kind``: ``--budget``)."""
        if self.adaptive or self.channels:
            return 1.0
        return kvpress_kept_count(n, ratio) if kind == "count" else round(1 - ratio, 10)

    def prompt(self, ids: list[int], header: list[int], rows: int, ratio: float) -> list[int]:
        """The ids both sides prefill for a context's ``ids``: after the chat template's ``header`` where the press
        expects it; for a pooled press over ``rows`` (layers × KV heads), cut at the end until kvpress's kept
        total ``rows·n − ⌊rows·n·ratio⌋`` is ``rows`` times its per-row count, which kvbench's budget (whole
        tokens per row) can then equal (at ratio 0.5: an even ``n``)."""
        out = (header if self.chat_header else []) + ids
        while (
            self.pooled
            and len(out) > 1
            and pooled_kept(len(out), rows, ratio) != rows * kvpress_kept_count(len(out), ratio)
        ):
            out = out[:-1]
        return out

    def press_label(self) -> str:
        if self.parts:
            return f"ComposedPress([{', '.join(part.press_label() for part in self.parts)}])"
        inner = f"{self.inner}({args(self.inner_kwargs)})" if self.inner else ""
        return f"{self.press}({', '.join(a for a in (inner, args(self.kwargs)) if a)})"

    def mean_ratio(self, ratio: float) -> float:
        """The share kvpress evicts on average: ``ratio``, or the mean of a per-layer press's own ratios."""
        ratios = self.kwargs.get("compression_ratios")
        return sum(ratios) / len(ratios) if ratios else ratio

    def config_label(self) -> str:
        return " ".join([f"policy={self.policy}", *(f"policy.{k}={v}" for k, v in self.overrides.items())])


def args(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


SNAPKV = {"window_size": 64, "kernel_size": 5}  # kvpress's defaults; kvbench's snapkv.yaml has window 32
# layers_snapkv.yaml's per-layer shares of the prompt (mean 0.5, the default --ratio): kvpress evicts the rest.
LAYER_SHARES = list(OmegaConf.load(REPO / "configs" / "policy" / "layers_snapkv.yaml").allocation.budgets)
METHODS: dict[str, Method] = {
    "streamingllm": Method("StreamingLLMPress", "streamingllm", {"n_sink": 4}),
    "tova": Method("TOVAPress", "tova"),
    "snapkv": Method("SnapKVPress", "snapkv", SNAPKV, {"score.window": 64, "score.kernel_size": 5}),
    "knorm": Method("KnormPress", "knorm"),
    "pyramidkv": Method(
        "PyramidKVPress", "pyramidkv", {**SNAPKV, "beta": 20}, {"score.window": 64, "allocation.beta": 20}
    ),
    "pyramidkv_kvpress": Method("PyramidKVPress", "pyramidkv_kvpress", {**SNAPKV, "beta": 20}),
    "adakv": Method(
        "AdaKVPress",
        "adakv",
        {"alpha_safeguard": 0.2},
        {"score.window": 64, "allocation.floor": 0.2},
        inner="SnapKVPress",
        inner_kwargs=SNAPKV,
    ),
    "layers_snapkv": Method(
        "PerLayerCompressionPress",
        "layers_snapkv",
        {"compression_ratios": [round(1 - share, 10) for share in LAYER_SHARES]},
        {"score.window": 64},
        inner="SnapKVPress",
        inner_kwargs=SNAPKV,
    ),
    "observed_attention": Method("ObservedAttentionPress", "mean_window", overrides={"scope.window": 0}, eager=True),
    "keydiff": Method("KeyDiffPress", "keydiff"),
    "lagkv": Method("LagKVPress", "lagkv", {"n_sink": 4, "lag_size": 128, "cross_scoring": False}),
    "chunkkv": Method("ChunkKVPress", "chunkkv", {"chunk_length": 20}, inner="SnapKVPress", inner_kwargs=SNAPKV),
    "chunkkv_kvpress": Method(
        "ChunkKVPress", "chunkkv_kvpress", {"chunk_length": 20}, inner="SnapKVPress", inner_kwargs=SNAPKV
    ),
    "entropy_gated_chunkkv": Method(
        "EntropyGatedChunkKVPress",
        "entropy_gated_chunkkv",
        {"chunk_length": 10, "low_entropy_chunk_length": 4},
        inner="SnapKVPress",
        inner_kwargs=SNAPKV,
    ),
    "expected_attention": Method("ExpectedAttentionPress", "expected_attention"),
    # The kept set is chosen before kvpress re-rotates the kept keys, which the peer side's key matching needs
    # unrotated (kvbench's config re-indexes them).
    "finch": Method("FinchPress", "finch", {"rerotate_keys": False}, question=32),
    "criticalkv": Method(
        "CriticalKVPress",
        "criticalkv",
        {"epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"score.base.window": 64, "score.epsilon": 0.0064},  # kvpress's ε on SnapKV's mean: 64 × it on the sum
        inner="SnapKVPress",
        inner_kwargs=SNAPKV,
    ),
    "criticalkv_adakv": Method(
        "CriticalAdaKVPress",
        "criticalkv_adakv",
        {"alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5},
        {"score.base.window": 64, "score.epsilon": 0.0064},
        inner="SnapKVPress",
        inner_kwargs=SNAPKV,
    ),
    "cur": Method("CURPress", "cur"),
    "cap": Method("CapPress", "cap"),
    "noncausal_attn": Method("NonCausalAttnPress", "noncausal_attn"),
    # kvpress's defaults: the structured variant, max over the re-read's queries, the heads' mean added.
    # kvpress keeps ⌊L·n·(1 − ratio)⌋ composite tokens over the model, kvbench L × budget: prompts cut as KVzip's.
    "kvcompose": Method("KVComposePress", "kvcompose", pooled=True),
    # kvpress's defaults but its lazy_threshold (1.0 makes no layer lazy): 0.9, its recommendation for Llama 3.
    "simlayerkv": Method("SimLayerKVPress", "simlayerkv", {"lazy_threshold": 0.9}, adaptive=True),
    # A window of 128 of the ~1,000-token prompts, where a lazy layer drops most of the prompt.
    "simlayerkv_128": Method(
        "SimLayerKVPress",
        "simlayerkv",
        {"lazy_threshold": 0.45, "n_recent": 128},
        {"score.lazy_threshold": 0.45, "score.n_recent": 128},
        adaptive=True,
    ),
    # kvpress's defaults but the ratio (its default 0 prunes nothing); the prompt's every token is kept.
    "think": Method("ThinKPress", "think", {"key_channel_compression_ratio": 0.5, "window_size": 32}, channels=True),
    "think_25": Method(
        "ThinKPress",
        "think",
        {"key_channel_compression_ratio": 0.25, "window_size": 64},
        {"channels.ratio": 0.25, "channels.window": 64},
        channels=True,
    ),
    # KVzip's replay passes: kvpress's chunk of 2,048 tokens repeats each ~1,000-token prompt in one pass.
    "kvzip": Method("KVzipPress", "kvzip", chat_header=True, pooled=True),
    "kvzip_plus": Method("KVzipPress", "kvzip_plus", {"kvzip_plus_normalization": True}, chat_header=True, pooled=True),
    # KVgrad's passes of 512 tokens (two or three per prompt), each with its backward.
    "kvgrad": Method("KVgradPress", "kvgrad", chat_header=True, pooled=True),
    # SnapKV's kept tokens, then ThinK's channels of the keys SnapKV kept: kvpress's defaults (ThinK's ratio 0.5).
    "think_snapkv": Method(
        "ComposedPress",
        "think_snapkv",
        overrides={"score.window": 64},
        parts=(
            Method("SnapKVPress", "snapkv", SNAPKV),
            Method("ThinKPress", "think", {"key_channel_compression_ratio": 0.5, "window_size": 32}, channels=True),
        ),
    ),
    # kvpress's on-the-fly head scores, calibrated on the prompt itself (scripts/peer_kvpress_side.py), against
    # duoattention.yaml's defaults (kvpress's on-the-fly sink and window sizes, half the heads streaming).
    "duoattention": Method(
        "DuoAttentionPress", "duoattention", {"head_compression_ratio": 0.5, "on_the_fly_scoring": True}, adaptive=True
    ),
    # Three quarters of the heads streaming: the ranking's lower end agrees too.
    "duoattention_75": Method(
        "DuoAttentionPress",
        "duoattention",
        {"head_compression_ratio": 0.75, "on_the_fly_scoring": True},
        {"score.head_ratio": 0.75},
        adaptive=True,
    ),
}


def policy_config(method: Method) -> dict[str, Any]:
    cfg = OmegaConf.load(REPO / "configs" / "policy" / f"{method.policy}.yaml")
    OmegaConf.set_struct(cfg, True)  # an override of a key the config lacks is a typo: refused
    for key, value in method.overrides.items():
        OmegaConf.update(cfg, key, value)
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict), "a policy config is a mapping"
    return {str(k): v for k, v in plain.items()}


def choose_prompts(data_dir: Path, subset: str, count: int, lo: int, hi: int) -> list[list[int]]:
    """The first ``count`` contexts of ``subset`` whose SmolLM2 tokens number ``lo`` to ``hi``."""
    tokenizer, _ = load_tokenizer("embedded")
    chosen = []
    for record in read_jsonl(data_dir / f"{subset}.jsonl"):
        ids = tokenizer(record["context"], add_special_tokens=False)["input_ids"]
        if lo <= len(ids) <= hi:
            chosen.append(list(ids))
        if len(chosen) == count:
            return chosen
    raise SystemExit(f"{subset} has {len(chosen)} contexts of {lo} to {hi} tokens, not {count}: widen the range")


def kvpress_kept_count(n: int, ratio: float) -> int:
    """What kvpress keeps of ``n`` entries at ``compression_ratio=ratio`` (rounded down, at least one)."""
    return max(1, int(n * (1 - ratio)))


def pooled_kept(n: int, rows: int, ratio: float) -> int:
    """What KVzipPress keeps in all of ``rows`` rows of ``n`` entries: it prunes ``⌊rows·n·ratio⌋``."""
    return rows * n - int(rows * n * ratio)


def run_peer(peer_python: str, methods: dict[str, Method], prompts: dict[str, list[list[int]]], ratio: float) -> Any:
    """kvpress's kept masks and scores of each method on its prompts (``prompts[method]``)."""
    with tempfile.TemporaryDirectory() as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "peer.npz"
        specs = {name: {**m.press_spec(), "prompts": prompts[name]} for name, m in methods.items()}
        request.write_text(json.dumps({"ratio": ratio, "methods": specs}), encoding="utf-8")
        subprocess.run([peer_python, str(PEER_SIDE), str(request), str(out)], check=True)
        with np.load(out) as got:
            return {key: got[key] for key in got.files}


class ScoreProbe:
    """Records the scores a policy ranks each layer's entries by (``Policy.scored``, protected entries at +inf),
    by (layer, KV head, position), NaN where it scored nothing."""

    def __init__(self, policy: Policy, layers: int, heads: int, n: int):
        self.heads = heads
        self.scores = np.full((layers, heads, n), np.nan, dtype=np.float32)
        self.scored = policy.scored
        policy.scored = self  # type: ignore[method-assign]

    def __call__(self, state: Any, budget: int, padding: float = float("-inf")) -> torch.Tensor:
        scores = self.scored(state, budget, padding)
        keys = state.row_keys[:, 0].cpu().numpy()
        valid = state.valid_mask().cpu().numpy()
        positions, values = state.positions.cpu().numpy(), scores.cpu().numpy()
        for row, key in enumerate(keys):
            layer, head = divmod(int(key), self.heads)
            mine = valid[row] & (positions[row] < self.scores.shape[2])  # not a re-read's own (Score.rereads)
            self.scores[layer, head, positions[row][mine]] = values[row][mine]
        return scores


def run_kvbench(lm: LoadedModel, method: Method, ids: list[int], budget: float | int) -> tuple[np.ndarray, np.ndarray]:
    """kvbench's kept mask and scores [layers, heads, n] after prefilling ``ids`` under the method's config."""
    config = lm.model.config
    layers, heads, n = config.num_hidden_layers, config.num_key_value_heads, len(ids)
    policy = build_policy(policy_config(method))
    probe = ScoreProbe(policy, layers, heads, n)
    settings = EngineSettings(policy=policy, budget=budget, stage="prefill", trace=True)
    asked = len(ids) - method.question
    request = Request(input_ids=ids[:asked], suffix_ids=ids[asked:], settings=DecodeSettings(max_new_tokens=1))
    generation = Engine(lm.model, lm.tokenizer, settings).run([request])[0]
    assert generation.trace is not None, "a traced run records its kept positions"
    kept = np.zeros((layers, heads, n), dtype=bool)
    for layer, positions in enumerate(generation.trace[0]):  # the prompt's forward: [heads, kept], padded
        kept[layer, np.arange(heads)[:, None], positions.cpu().numpy()] = True
    return kept, probe.scores


class ChannelProbe:
    """Records each layer's channel scores and kept channels as ``KeyChannels`` computes them (the prompt cache's
    layers prune in order, one call each), as a kept mask and scores [layers, heads, D]."""

    def __init__(self) -> None:
        self.scores: list[np.ndarray] = []
        self.kept: list[np.ndarray] = []

    def __enter__(self) -> ChannelProbe:
        self.saved = KeyChannels.scores, KeyChannels.keep
        scores, keep = self.saved

        def scoring(channels: KeyChannels, query_energy: torch.Tensor, key_energy: torch.Tensor) -> torch.Tensor:
            got = scores(channels, query_energy, key_energy)
            self.scores.append(got.cpu().numpy())
            return got

        def keeping(channels: KeyChannels, ranked: torch.Tensor) -> torch.Tensor:
            got = keep(channels, ranked)
            mask = np.zeros(ranked.shape, dtype=bool)
            mask[np.arange(ranked.shape[0])[:, None], got.cpu().numpy()] = True
            self.kept.append(mask)
            return got

        KeyChannels.scores, KeyChannels.keep = scoring, keeping  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        KeyChannels.scores, KeyChannels.keep = self.saved  # type: ignore[method-assign]


def run_kvbench_kinds(
    lm: LoadedModel, method: Method, ids: list[int], budget: float | int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """kvbench's kept sets and scores of each of the method's kinds (``Method.kinds``), from one run."""
    if method.kinds == ("channels",):
        return {"channels": run_kvbench_channels(lm, method, ids)}
    with ChannelProbe() as probe:  # records nothing where the policy prunes no channel
        got = {"tokens": run_kvbench(lm, method, ids, budget)}
    if probe.kept:
        got["channels"] = np.stack(probe.kept), np.stack(probe.scores)
    return got


def run_kvbench_channels(lm: LoadedModel, method: Method, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """kvbench's kept channels and channel scores [layers, heads, D] after prefilling ``ids`` (every token kept)."""
    settings = EngineSettings(policy=build_policy(policy_config(method)), budget=1.0, stage="prefill")
    request = Request(input_ids=ids, settings=DecodeSettings(max_new_tokens=1))
    with ChannelProbe() as probe:
        Engine(lm.model, lm.tokenizer, settings).run([request])
    return np.stack(probe.kept), np.stack(probe.scores)


BEGIN, END = "<!-- BEGIN measured by scripts/peer_agreement.py -->", "<!-- END measured -->"


def with_section(document: str, section: str) -> str:
    """``document`` with the text between its BEGIN and END markers replaced by ``section``."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"the page has no {BEGIN} ... {END} markers to write the table between")
    return document[: start + len(BEGIN)] + "\n" + section + "\n" + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", required=True, help="the Python of the environment kvpress is installed in")
    parser.add_argument("--data-dir", type=Path, required=True, help="a folder holding LongBench's <subset>.jsonl")
    parser.add_argument("--subset", default="multi_news")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=1200)
    parser.add_argument("--ratio", type=float, default=0.5, help="kvpress's compression_ratio (the share evicted)")
    parser.add_argument("--budget", choices=("count", "fraction"), default="count")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--eps", type=float, default=1e-5, help="relative score difference read as a tie")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "peers.md")
    a = parser.parse_args(argv)
    methods = {name: METHODS[name] for name in a.methods}
    contexts = choose_prompts(a.data_dir, a.subset, a.prompts, a.min_tokens, a.max_tokens)
    lm = load_model("smollm2", source="embedded", dtype="float32", device="cpu")
    rows = lm.model.config.num_hidden_layers * lm.model.config.num_key_value_heads
    header = template_ends(lm.tokenizer)[0]
    prompts = {
        name: [m.prompt(ids, header, rows, m.mean_ratio(a.ratio)) for ids in contexts] for name, m in methods.items()
    }
    peer = run_peer(a.peer_python, methods, prompts, a.ratio)
    table_rows, notes = [], []
    for name, method in methods.items():
        agreements = {kind: Agreement() for kind in method.kinds}
        for index, ids in enumerate(prompts[name]):
            budget = method.budget(len(ids), method.mean_ratio(a.ratio), a.budget)
            ours = run_kvbench_kinds(lm, method, ids, budget)
            for kind, agreement in agreements.items():
                kept, scores = ours[kind]
                at = f"{name}/{index}/{kind}"
                compare(agreement, index, kept, peer[f"{at}/kept"], peer[f"{at}/scores"], scores, a.eps)
        for kind, agreement in agreements.items():
            label = f"{name} ({kind})" if len(agreements) > 1 else name
            table_rows.append((label, method.press_label(), method.config_label(), agreement))
            notes += unexplained_rows(label, agreement)
            print(f"{label}: {agreement.identical}/{agreement.rows} rows identical", flush=True)
    import transformers

    versions = json.loads(str(peer["versions"]))
    setup = (
        f"Measured on {len(contexts)} LongBench `{a.subset}` contexts of {', '.join(str(len(p)) for p in contexts)} "
        f"tokens, SmolLM2-135M-Instruct (float32, CPU), `compression_ratio={a.ratio}`, kvbench's budget "
        f"{'kvpress kept count in tokens' if a.budget == 'count' else 'the fraction 1 - ratio'}: kvpress "
        f"{versions['kvpress']} (transformers {versions['transformers']}, torch {versions['torch']}) against "
        f"kvbench (transformers {transformers.__version__}, torch {torch.__version__})."
    )
    unexplained = ["Unexplained rows (positions only one side kept, with both sides' scores):", "", *notes]
    section = "\n\n".join([setup, table(table_rows), *(["\n".join(unexplained)] if notes else [])])
    print(section)
    a.out.write_text(with_section(a.out.read_text(encoding="utf-8"), section), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
