"""Shared fixtures: a tiny random Llama for fast exact checks, SmolLM2 and Gemma 3 270M for the real-model ones."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from kvbench.models import LoadedModel, load_model
from kvbench.registry import Registry
from kvbench.tasks.base import Task
from kvbench.tasks.registry import build_task

# Tests never reach the Hugging Face hub: local files only, and nothing may hang on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own folder: a cell's default ``results_dir`` (and its stored references) is
    relative, and a test must neither write into the checkout nor read what an earlier run left there."""
    monkeypatch.chdir(tmp_path)


# The named policies' token counts are sized for real prompts; tests on tiny prompts (tens of tokens) cap every
# part option that counts tokens, by the option's name, so that a new policy needs no entry here.
TINY_COUNTS = {"window": 6, "history": 6, "n_recent": 4, "n_sink": 4}


def tiny_counts(cfg: dict) -> dict:
    """``cfg`` with every integer option named in ``TINY_COUNTS`` capped there, at any depth."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            value = tiny_counts(value)
        elif key in TINY_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            value = min(value, TINY_COUNTS[key])
        out[key] = value
    return out


def tiny_policy_cfg(name: str, **extra) -> dict:
    """A named policy's config with ``extra`` merged in, its token counts capped for tiny prompts."""
    cfg = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "policy" / f"{name}.yaml"), extra)
    return tiny_counts(OmegaConf.to_container(cfg, resolve=True))


def fit_layers(cfg: dict, n_layers: int) -> dict:
    """``cfg`` with an explicit per-layer budget list (``allocation=layers``) resampled to ``n_layers`` entries
    (evenly spaced picks, the first and last kept): a shipped list names one model's layers, the tests' models
    have others."""
    allocation = cfg.get("allocation")
    if not (isinstance(allocation, dict) and allocation.get("kind") == "layers"):
        return cfg
    listed = allocation["budgets"]
    picks = [round(i * (len(listed) - 1) / max(n_layers - 1, 1)) for i in range(n_layers)]
    return cfg | {"allocation": allocation | {"budgets": [listed[i] for i in picks]}}


_CENTRES: dict[int, str] = {}


def with_calibration(cfg: dict, model) -> dict:
    """``cfg`` with TriAttention's calibration, where its score needs one: the query centres of ``model`` on a fixed
    token sequence, measured once per model into a temporary file."""
    score = cfg.get("score")
    if not (isinstance(score, dict) and score.get("kind") == "triattention" and score.get("calibration") is None):
        return cfg
    if id(model) not in _CENTRES:
        from kvbench.profile.query_centres import measure

        path = Path(tempfile.mkdtemp()) / "centres.npz"
        measure(model, [(7 * i + 3) % 250 for i in range(48)]).save(path)
        _CENTRES[id(model)] = str(path)
    return cfg | {"score": score | {"calibration": _CENTRES[id(model)]}}


def keeping_all(cfg: dict) -> dict:
    """A policy's config as a budget of the sequence length keeps everything: a threshold allocation decides
    what is kept whatever the budget, so there it gets the threshold every score reaches; key channels (ThinK) are
    pruned whatever the budget, so there every channel is kept (a ratio of 0)."""
    channels = cfg.get("channels")
    if isinstance(channels, dict):
        cfg = cfg | {"channels": channels | {"ratio": 0.0}}
    allocation = cfg.get("allocation")
    if isinstance(allocation, dict) and allocation.get("kind") == "threshold":
        return cfg | {"allocation": allocation | {"threshold": float("-inf")}}
    return cfg


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    lm = load_model("tiny-llama", source="tiny", dtype="float32", device="cpu")
    # A random model rarely samples EOS, but a test must not depend on luck: never stop early.
    lm.model.generation_config.eos_token_id = None
    return lm


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m", source="embedded", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    return load_model("gemma3-270m", source="embedded", embedded="gemma3-270m", dtype="float32", device="cpu")


@pytest.fixture
def random_ids():
    def make(n: int, seed: int = 0, high: int = 250) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, high, (n,), generator=g).tolist()

    return make


@pytest.fixture
def one_thread():
    """Tiny tensors on a shared 2-core machine: one thread is ~10× faster than contended threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on a real model (SmolLM2, Gemma 3 270M) is ``real_model``; ``gpu`` tests are skipped where torch sees
    no CUDA, with the reason."""
    skip = pytest.mark.skip(reason="needs CUDA; torch sees no GPU here")
    for item in items:
        if {"smollm", "gemma"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


def registries() -> tuple[Registry, ...]:
    """Every registry of the package (tests/test_registry.py checks that no other exists)."""
    from kvbench.metrics.registry import METRICS
    from kvbench.policies.merge import MERGES
    from kvbench.policies.parts import ALLOCATIONS, SCOPES, SCORES, SPARSITIES
    from kvbench.policies.quantize import QUANTIZERS
    from kvbench.tasks.registry import TASKS

    return SCORES, SCOPES, ALLOCATIONS, SPARSITIES, QUANTIZERS, MERGES, TASKS, METRICS


@pytest.fixture(autouse=True)
def names_a_test_registers_are_forgotten() -> Iterator[None]:
    """A test may register its own score, task, metric...; the next test sees the names as they were (error
    messages list them, and the profiler measures every registered score)."""
    before = {registry: set(registry.names()) for registry in registries()}
    yield
    for registry, names in before.items():
        for name in set(registry.names()) - names:
            registry.unregister(name)


def task_from_config(name: str, **options: Any) -> Task:
    """The task as its config declares it (hub source, columns), with ``options`` changed."""
    cfg = yaml.safe_load((REPO / "configs" / "task" / f"{name}.yaml").read_text())
    cfg.pop("fidelity", None)
    task = build_task({**cfg, **options})
    assert isinstance(task, Task)
    return task


@pytest.fixture
def forwards(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every forward's token count from here on, as the embedding sees it; cells run on this very model (how
    compress-once tests count the prefills of a context)."""
    from kvbench.runner import model_cache

    monkeypatch.setattr(model_cache, "get_model", lambda *_: tiny)
    fed: list[int] = []
    handle = tiny.model.get_input_embeddings().register_forward_hook(lambda _m, args, _o: fed.append(args[0].shape[1]))
    yield fed
    handle.remove()


def alone_text(tiny: LoadedModel, context: list[int], question: list[int]) -> str:
    """A plain run of the context, compressed alone by ``window`` at budget 0.5 in stage prefill, then the question:
    what a compress-once cell with those settings must answer."""
    from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
    from kvbench.policies.registry import build_policy

    policy = build_policy(OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / "window.yaml")))
    request = Request(context, question, DecodeSettings(max_new_tokens=4))
    return Engine(tiny.model, tiny.tokenizer, EngineSettings(policy, 0.5, "prefill")).run([request])[0].text
