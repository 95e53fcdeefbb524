"""Load a model and its tokenizer: an embedded GGUF (SmolLM2-135M-Instruct or Gemma 3 270M), any hub id or
local directory, or a tiny random Llama for tests. Loading never touches the network unless a hub id is
asked for, and every real tokenizer is sanity-checked on load (see :func:`check_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.embedded import embedded_checkpoint
from kvbench.tokenizer_check import check_tokenizer

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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


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


def tiny_llama_config(vocab_size: int = 264, max_positions: int = TINY_MAX_POSITIONS) -> Any:
    """The config of ``tiny_llama``: 4 layers, grouped-query attention (4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )


def tiny_llama(seed: int = 0, vocab_size: int = 264, max_positions: int = TINY_MAX_POSITIONS) -> Any:
    """A small random Llama with grouped-query attention, deterministic for a seed."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(vocab_size, max_positions))
    return model


def local_path_problem(name_or_path: str) -> str | None:
    """Why ``name_or_path`` cannot be loaded as a local model, or None (a local directory holding config.json, or
    a hub id). A path that looks local (``./``, ``../``, ``/``, ``~``, more than one ``/``) is never sent to the
    hub, whose answer to one is an error about repo ids."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return f"model.name_or_path={name_or_path} holds no config.json; point it at a saved model's directory"
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path
    if path.exists() or looks_local:
        return (
            f"model.name_or_path={name_or_path} is not a model directory; give a local directory holding "
            "config.json, or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    return None


def checkpoint_path(
    source: str, name_or_path: str | None, cache_dir: str | None, embedded: str | None = None
) -> tuple[str, bool]:
    """Where to load from and whether it is local (local loads never touch the network)."""
    if source == "embedded":
        return str(embedded_checkpoint(cache_dir, embedded)), True
    if source == "pretrained":
        if not name_or_path:
            raise ValueError("model.source=pretrained needs model.name_or_path=<hub id or local dir>")
        return name_or_path, Path(name_or_path).is_dir()
    raise ValueError(f"unknown model.source {source!r}; choose embedded, pretrained or tiny")


def load_config(
    source: str = "embedded",
    name_or_path: str | None = None,
    cache_dir: str | None = None,
    embedded: str | None = None,
    **_: Any,
) -> Any:
    """The model's config alone (no weights): what kvbench decides support and layer plans from."""
    from transformers import AutoConfig

    if source == "tiny":
        return tiny_llama_config()
    path, local = checkpoint_path(source, name_or_path, cache_dir, embedded)
    return AutoConfig.from_pretrained(path, local_files_only=local)


def load_tokenizer(
    source: str = "embedded",
    name_or_path: str | None = None,
    cache_dir: str | None = None,
    embedded: str | None = None,
    **_: Any,
) -> tuple[Any, int]:
    """The tokenizer and the model's context limit, without loading any weights.

    Every real tokenizer passes :func:`check_tokenizer` first: a wrong-class load (spaces to the
    unknown token, a start token as EOS) would otherwise silently ruin every score.
    """
    from transformers import AutoTokenizer

    if source == "tiny":
        return tiny_tokenizer(), TINY_MAX_POSITIONS
    path, local = checkpoint_path(source, name_or_path, cache_dir, embedded)
    config = load_config(source, name_or_path, cache_dir, embedded)
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
    fix = f"delete {path} so it is converted again under this transformers version" if source == "embedded" else None
    check_tokenizer(tokenizer, path, fix)
    return tokenizer, limit


def load_model(
    name: str,
    source: str = "embedded",
    name_or_path: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    seed: int = 0,
    embedded: str | None = None,
) -> LoadedModel:
    """Load by source: ``embedded`` (the GGUF named by ``embedded``: smollm2, the default, or
    gemma3-270m), ``pretrained`` (hub id or local dir), ``tiny``."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer, _ = load_tokenizer(source, name_or_path, cache_dir, embedded)
    if source == "tiny":
        model = tiny_llama(seed=seed)
    else:
        path, local = checkpoint_path(source, name_or_path, cache_dir, embedded)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=local)
    model.to(device=dev, dtype=dt)
    model.eval()
    # Gemma's pad id is 0, so test for None rather than truthiness.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.generation_config.pad_token_id = pad
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=dev, dtype=dt)
