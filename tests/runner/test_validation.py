"""Every bad input is refused with one clear message before any model weights load.

Each case runs the real entry point (``kvbench.run.main``, Hydra and all) in this process, with the
model loaders replaced by ones that fail the test, and checks the exit status, the message, and that
no cell wrote rows.
"""

from __future__ import annotations

import os
import shlex
import sys

import pytest
import torch
from conftest import REPO, SHARED_DATA, registries
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import kvbench.models
import kvbench.run as entry
from kvbench.config.spec import ConfigError
from kvbench.config.validate import validate, validate_engine
from kvbench.policies.base import Score
from kvbench.policies.parts import register_score
from kvbench.policies.registry import build_policy
from kvbench.runner import model_cache

TINY = ["model=tiny-llama", "task.n=2", "task.context_tokens=128", "task.max_new_tokens=4"]


def build_policy_named(name: str):
    """A named policy as its config builds it (no model)."""
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "policy" / f"{name}.yaml"), resolve=True)
    return build_policy(cfg)


REFUSED = REPO / "tests" / "runner" / "refused"  # small bad input files, committed so that the doc's paths are stable
HAYSTACK = REPO / "tests" / "runner" / "haystack"  # a few sentences of text, for refusals that come after reading it
DOC = REPO / "docs" / "refused_inputs.md"


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """Run ``kvbench-run ARGS`` in-process; returns (exit status, stderr). Loading weights fails the test."""

    def no_weights(*args, **kwargs):
        pytest.fail(f"model weights were loaded before validation refused the config: {args} {kwargs}")

    monkeypatch.setattr(model_cache, "load_model", no_weights)
    monkeypatch.setattr(kvbench.models, "load_model", no_weights)
    monkeypatch.setattr(model_cache, "get_model", no_weights)

    def run(*args: str) -> tuple[int, str]:
        GlobalHydra.instance().clear()
        # No logging set-up: Hydra's dictConfig would close handlers bound to pytest's captured streams.
        quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none"]
        monkeypatch.setattr(sys, "argv", ["kvbench-run", *args, f"results_dir={tmp_path}", "sweep_name=v", *quiet])
        try:
            with pytest.raises(SystemExit) as exit_info:
                entry.main()
        finally:
            GlobalHydra.instance().clear()
        err = capsys.readouterr().err
        assert not list(tmp_path.rglob("rows.jsonl")), "a refused config wrote rows"
        return exit_info.value.code, err

    return run


def one_message(err: str) -> str:
    """The kvbench message (one line, no traceback)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kvbench: ")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- Hydra: unknown options and keys


@pytest.mark.parametrize(
    "group, choice, listed",
    [
        ("policy", "nope", ["full", "window", "streamingllm", "random"]),
        ("task", "nope", ["retrieval", "xsum", "longbench"]),
        ("model", "nope", ["tiny-llama", "smollm2-135m"]),
        ("experiment", "nope", ["smoke", "main", "roco_paper"]),
        ("hydra/launcher", "nope", ["basic", "joblib", "submitit_local", "submitit_slurm"]),
    ],
)
def test_unknown_option_lists_the_choices(cli, group, choice, listed):
    code, err = cli(*TINY, f"{group}={choice}")
    assert code == 1
    assert f"Could not find '{group}/{choice}'" in err
    assert f"Available options in '{group}'" in err
    for name in listed:
        assert f"\t{name}\n" in err
    assert "Traceback" not in err


def test_unknown_key_is_refused(cli):
    code, err = cli(*TINY, "budgett=0.5")
    assert code == 1
    assert "Could not override 'budgett'" in err and "Key 'budgett' is not in struct" in err


# ---------------------------------------------------------------- kvbench's own checks


CASES = [
    (["stage=sideways"], "stage='sideways' is unknown; choose one of prefill, decode, both"),
    (["policy=window", "budget=1.5"], "budget=1.5 is out of range: give a fraction in (0, 1]"),
    (["policy=window", "budget=-0.2"], "budget=-0.2 is out of range"),
    (["policy=window", "budget=0"], "budget=0 must be at least 1 token"),
    (["policy=window", "budget=lots"], "budget='lots' must be a number"),
    (["stride=0"], "stride=0 must be a positive integer"),
    (["stride=1.5"], "stride=1.5 must be a positive integer"),
    (["max_new_tokens=0"], "max_new_tokens=0 must be a positive integer or null"),
    (["max_new_tokens=-3"], "max_new_tokens=-3 must be a positive integer or null"),
    (["seed=abc"], "seed='abc' must be an integer"),
    (["sampling.do_sample=true", "sampling.temperature=0"], "sampling.temperature=0 must be > 0"),
    (["sampling.do_sample=true", "sampling.top_p=1.5"], "sampling.top_p=1.5 must be in (0, 1]"),
    (["sampling.temperature=hot"], "sampling.temperature='hot' must be a number"),
    (["sampling.n_samples=0"], "sampling.n_samples=0 must be a positive integer (samples drawn per prompt)"),
    (["sampling.n_samples=4"], "sampling.n_samples=4 needs sampling.do_sample=true"),
    (
        ["task=perplexity", "sampling.do_sample=true", "sampling.n_samples=2"],
        "task=perplexity teacher-forces its text instead of generating",
    ),
    (["task=math"], "task.path must be set (it is ??? in the config): add task.path=... to the command line"),
    (["task=math", "task.path=/nonexistent/gsm8k.jsonl"], "task.path=/nonexistent/gsm8k.jsonl does not exist"),
    (["task=math", "task.path=x.jsonl", "task.format=gsm9k"], "task.format=gsm9k is unknown; choose one of gsm8k"),
    (["model.source=weird"], "model.source='weird' is unknown; choose one of embedded, pretrained, tiny"),
    (["model.dtype=float8"], "model.dtype='float8' is unknown; choose one of auto, float32, float16, bfloat16"),
    (["model.device=tpu"], "model.device='tpu' is unknown; choose auto, cpu, cuda, cuda:N or mps"),
    (
        ["policy=streamingllm", "budget=4"],
        "budget=4 tokens is below the 5 tokens policy 'streamingllm' always protects",
    ),
    (["policy=streamingllm", "budget=0.01"], "example passkey-0: budget=0.01 of its 206 tokens: 3 tokens is below"),
    (["task.n=null"], "task.n must be a whole number >= 1 (synthetic prompts have no 'all'), not None"),
    (["policy=window", "policy.score=bogus"], "policy=window: unknown score 'bogus'"),
    (
        ["policy=layers_snapkv"],
        "model=tiny-llama: allocation=layers lists 30 budgets; this model splits its budget over 4 layers: give "
        "policy.allocation.budgets one share per layer (4 values)",
    ),
    (
        ["policy=layers_snapkv", "policy.allocation.budgets=[0.5,1.5,0.5,0]"],
        "policy=layers_snapkv: budgets [1.5, 0] must each be a share of the prompt in (0, 1]",
    ),
    (["policy=global_snapkv", "policy.merge=true"], "ranks every layer together, and a merge folds entries"),
    (["task.context_tokens=20000"], "tokens (prompt + max_new_tokens) exceed the model's limit of 16384"),
    (["task=lm_eval"], "task.tasks must be set (it is ??? in the config): add task.tasks=... to the command line"),
    (["task=lm_eval", "task.tasks=[no_such_task]"], "lm-eval has no task 'no_such_task'; `lm-eval ls tasks`"),
    (["task=jsonl"], "task.path must be set (it is ??? in the config): add task.path=... to the command line"),
    (["task=jsonl", "task.path=/nonexistent/prompts.jsonl"], "task.path=/nonexistent/prompts.jsonl does not exist"),
    (
        ["task=xsum", "task.data_dir=/nonexistent/xsum"],
        "/nonexistent/xsum/test.jsonl does not exist. Set task.data_dir=... to a folder holding test.jsonl",
    ),
    (["task=longbench", "task.subset=klingon"], "unknown LongBench subset 'klingon'"),
    (
        ["task=longbench", "task.ask=each"],
        "task.ask=each compresses each context once, before any of its questions is seen; "
        "add task.question_aware=false",
    ),
    (["task=retrieval", "task.needle=haystack"], "task.needle must be 'passkey' or 'kv', not 'haystack'"),
    (["task=ruler", "task.subset=niah_single_9"], "unknown RULER subset 'niah_single_9'; choose one of"),
    (["task=ruler", "task.context_tokens=20000"], "task.context_tokens=20000 is longer than model=tiny-llama can hold"),
    (
        ["task=ruler", "task.subset=niah_single_2", "task.haystack_dir=/nonexistent/essays"],
        "task.haystack_dir=/nonexistent/essays is not a folder; point it at a folder of .txt files",
    ),
    (
        ["task=ruler", "task.subset=niah_single_2", f"task.haystack_dir={REFUSED}"],
        "holds no non-empty .txt file; the essay haystack reads them",
    ),
    (
        ["task=ruler", "task.subset=qa_1", "task.qa_path=/nonexistent/squad.jsonl"],
        "task.qa_path=/nonexistent/squad.jsonl does not exist; point it at a JSONL file of rajpurkar/squad_v2 rows",
    ),
    (["task=niah", "task.depth=150"], "task.depth=150.0 must be a percent in [0, 100] of the haystack before the"),
    (["task=niah", "task.depth=-5"], "task.depth=-5.0 must be a percent in [0, 100]"),
    (
        ["task=niah", "task.haystack_dir=/nonexistent/essays"],
        "task.haystack_dir=/nonexistent/essays is not a folder; point it at a folder of .txt files",
    ),
    (["task=niah", f"task.haystack_dir={REFUSED}"], "holds no non-empty .txt file; the essay haystack reads them"),
    (
        ["task=niah", f"task.haystack_dir={HAYSTACK}", "task.context_tokens=20000"],
        "task=niah: task.context_tokens=20000 is longer than model=tiny-llama can hold (16384 tokens)",
    ),
    # A task's options are the fields of its dataclass: an unknown one is refused with the list, a value typed.
    (
        ["+task.bogus=1"],
        "task=retrieval: task.bogus is unknown; the task's options are chat_template, context_tokens, depths, "
        "fidelity, max_new_tokens, n, n_pairs, needle, question_aware, seed",
    ),
    (["task=xsum", "+task.bogus=1"], "task=xsum: task.bogus is unknown; the task's options are chat_template, columns"),
    (["task.context_tokens=lots"], "task=retrieval: task.context_tokens='lots' must be an integer"),
    (["task.depths=[0.5,deep]"], "task=retrieval: task.depths=[0.5, 'deep'] must be a list of numbers or null"),
    (["task=xsum", "+task.source.mirror=x"], "task=xsum: task.source.mirror is unknown; the options there are archive"),
    (["tracking.wandb.mode=loud"], "tracking.wandb.mode='loud' is unknown; choose one of online, offline, disabled"),
    (["model=hf"], "model.source=pretrained needs model.name_or_path=<hub id or local directory>"),
    (["model=hf", "model.name_or_path=./nope"], "model.name_or_path=./nope is not a model directory"),
    (
        ["task=jsonl", f"task.path={REFUSED}/bad_line.jsonl"],
        "bad_line.jsonl:2: not valid JSON (Expecting ',' delimiter at column 38); fix or remove the line",
    ),
    (
        ["task=jsonl", f"task.path={REFUSED}/no_prompt.jsonl"],
        "no_prompt.jsonl:2: every line needs a 'prompt' field holding text",
    ),
    (["task.n=0"], "task.n=0 must be a positive integer (how many examples) or null (every example)"),
    (["task.n=-1"], "task.n=-1 must be a positive integer (how many examples) or null (every example)"),
    (["capacity.memory_gib=0"], "capacity.memory_gib=0 must be a positive number of GiB"),
    (["batch_size=0"], "batch_size=0 must be a positive integer (sequences decoded together)"),
    (["policy=h2o", "policy.quantize=int4"], "policy.quantize='int4' is unknown; choose one of none, fp8, int8"),
    (["policy=h2o", "policy.merge=maybe"], "policy.merge='maybe' must be true or false"),
    (["policy=cam", "policy.merge.merge_budget=0"], "policy=cam: merge_budget=0 must be a positive integer"),
    (
        ["policy=h2o", "policy.scope.window=1.5"],
        "policy=h2o: scope.window=1.5 must be a fraction in [0, 1] of the budget or an integer count",
    ),
    # A part's options are typed by its __init__'s hints, and a key it does not take is refused with its options.
    (["policy=h2o", "policy.scope.window=abc"], "policy=h2o: scope.window='abc' must be a number"),
    (["policy=h2o", "policy.scope.n_sink=1.5"], "policy=h2o: scope.n_sink=1.5 must be an integer"),
    (
        ["policy=h2o", "+policy.scope.windw=1"],
        "policy=h2o: scope 'sinks_window' has no option windw; its options are n_sink, window",
    ),
    # Key channels (ThinK): a ratio that keeps no channel, reindexed keys, queries read before RoPE.
    (
        ["policy=think", "policy.channels.ratio=1"],
        "policy=think: channels.ratio=1 must be at least 0 and below 1 (the share of key channels pruned; 1 keeps no",
    ),
    (
        ["policy=think", "policy.positions=reindex"],
        "policy=think: channels prunes the rotated keys' channels, and positions=reindex rotates kept keys again",
    ),
    (
        ["policy=expected_attention", "policy.channels={kind:think,ratio:0.5}"],
        "policy=expected_attention: score ExpectedAttention reads the queries before RoPE, which need every key",
    ),
    (
        ["policy=h2o", "policy.interval=0"],
        "policy.interval=0 must be a positive integer (decode steps from one eviction to the next; 1: every step)",
    ),
    # A policy per phase: stage=both only, and each phase's policy must be able to evict there.
    (
        ["policy=snapkv", "policy.decode=h2o"],
        "policy.decode=h2o names a policy per phase, which needs stage=both (stage=prefill evicts in one phase",
    ),
    (
        ["stage=both", "policy=h2o", "policy.decode=snapkv"],
        "policy=h2o: policy.decode=snapkv cannot evict in the decode phase: SnapKV scores the prompt",
    ),
    (
        ["stage=both", "policy.prefill=cap", "policy.decode=h2o"],
        "policy.prefill=cap policy.decode=h2o needs the run's own policy=NAME: it rules the other phase",
    ),
    (
        ["stage=both", "policy=cap"],
        "policy=cap cannot run in stage=both; use stage in ['prefill'] (or keep stage=both and name a policy for the "
        "decode phase: policy.decode=h2o)",
    ),
    # Policy.unsupported_stages: SnapKV scores from the prompt's observation window, so it only compresses a prompt.
    (["policy=snapkv", "stage=decode"], "policy=snapkv cannot run in stage=decode; use stage in ['prefill', 'both']"),
    (["policy=chunkkv", "policy.score.chunk=0"], "policy=chunkkv: chunkkv chunk=0 must be at least 1 token"),
    (
        ["policy=chunkkv", "policy.allocation=adaptive"],
        "policy=chunkkv: score.shared=true (on the score or its base) keeps one set per layer",
    ),
    (
        ["policy=entropy_gated_chunkkv", "policy.score.low_entropy_chunk=10"],
        "policy=entropy_gated_chunkkv: entropy_gated_chunkkv needs chunk > low_entropy_chunk >= 1",
    ),
    (["policy=cake", "policy.allocation.tau1=0"], "policy=cake: cake tau1=0, tau2=1.0 must be > 0"),
    (["policy=cake", "stage=both"], "policy=cake cannot run in stage=both; use stage in ['prefill']"),
    # Finch observes the question: the task must feed it apart from the context, one question per context.
    (
        ["policy=finch"],
        "policy=finch observes the prompt's question, and task=retrieval compresses its question with the context; "
        "add task.question_aware=false",
    ),
    (
        ["policy=finch", "task.question_aware=false", "stride=64"],
        "policy=finch compresses the prompt once, observing the question at its end, so it needs the prompt in one "
        "step; use stride=null",
    ),
    (["policy=finch", "stage=both"], "policy=finch cannot run in stage=both; use stage in ['prefill']"),
    (["policy=lagkv", "policy.score.lag_size=0"], "policy=lagkv: lagkv lag_size=0 must be at least 1 token"),
    # R-KV compresses what the model generates.
    (["policy=rkv", "stage=prefill"], "policy=rkv cannot run in stage=prefill; use stage in ['decode', 'both']"),
    # A threshold keeps what its base score reaches: the full cache has no score, and the value has no default.
    (
        ["policy=full", "policy.allocation=threshold"],
        "policy=full: a threshold keeps the entries whose score reaches it, and score=none has no score",
    ),
    (
        ["policy=h2o", "policy.allocation=threshold"],
        "policy=h2o: allocation 'threshold' needs option threshold (allocation.threshold=...)",
    ),
    # Score.whole_prompt: non-causal chunked attention reads every prompt query, so the prompt comes in one step.
    (["policy=noncausal_attn", "stride=64"], "policy=noncausal_attn scores the prompt from every prompt query"),
    # Score.rereads: KVCompose feeds the prompt twice, the second pass's every query scoring the first.
    (["policy=kvcompose", "stride=64"], "policy=kvcompose scores the prompt from every query of a second pass"),
    (["policy=kvcompose", "stage=decode"], "policy=kvcompose cannot run in stage=decode; use stage in ['prefill']"),
    # TriAttention's calibration (the model's query centres) is a file measured once per model.
    (
        ["policy=triattention", "stage=decode"],
        "score=triattention needs the model's query centres: measure them with python -m kvbench.profile.query_centres",
    ),
    (
        ["policy=triattention", "stage=decode", "policy.score.calibration=no/such/centres.npz"],
        "policy.score.calibration=no/such/centres.npz is not a file",
    ),
    (
        ["policy=triattention", "stage=prefill"],
        "policy=triattention cannot run in stage=prefill; use stage in ['decode']",
    ),
    (["policy=cap", "stage=both"], "policy=cap cannot run in stage=both; use stage in ['prefill']"),
    # SimLayerKV decides each layer once, from the prompt's last queries.
    (["policy=simlayerkv", "stage=decode"], "policy=simlayerkv cannot run in stage=decode; use stage in ['prefill']"),
    (["policy=simlayerkv", "policy.score.lazy_threshold=0"], "lazy_threshold=0 must be in (0, 1]"),
    (["policy=simlayerkv", "policy.score.lazy_threshold=1.5"], "lazy_threshold=1.5 must be in (0, 1]"),
    (["policy=simlayerkv", "policy.score.n_recent=-8"], "n_recent=-8 must be >= n_last=1"),
    (["policy=simlayerkv", "policy.score.n_initial=-1"], "n_initial=-1 must be >= 0 sink tokens"),
    # Quest chooses the keys each decode query attends and never evicts: the prompt is attended in full.
    (["policy=quest", "stage=prefill"], "policy=quest cannot run in stage=prefill; use stage in ['decode']"),
    (["policy=quest", "stage=both"], "policy=quest cannot run in stage=both; use stage in ['decode']"),
    (
        ["policy=quest", "stage=decode", "policy.sparsity.page_size=0"],
        "policy=quest: sparsity.page_size=0 must be a positive integer (keys per page; 16)",
    ),
    (["policy=quest", "stage=decode", "policy.sparsity.page_size=2.5"], "sparsity.page_size=2.5 must be an integer"),
    (
        ["policy=quest", "stage=decode", "policy.sparsity.dense_layers=-1"],
        "policy=quest: sparsity.dense_layers=-1 must be an integer >= 0",
    ),
    (
        ["policy=quest", "stage=decode", "policy.channels={kind:think,ratio:0.5}"],
        "policy=quest: a decode-time sparsity bounds each page's keys over every channel",
    ),
    (
        ["policy=h2o", "stage=decode", "policy.sparsity=quest"],
        "policy=h2o: a sparsity part chooses the keys a full cache's queries attend, and the budget counts them; it "
        "cannot combine with an evicting score: use score=none",
    ),
    # KVzip replays the prompt once, after it is fed: nothing to replay in the decode phase.
    (["policy=kvzip", "stage=decode"], "policy=kvzip cannot run in stage=decode; use stage in ['prefill']"),
    (["policy=kvzip_plus", "stage=both"], "policy=kvzip_plus cannot run in stage=both; use stage in ['prefill']"),
    (["policy=kvzip", "policy.score.chunk=0"], "replay chunk=0 must be >= 1 token"),
    # KVgrad back-propagates through each pass's own keys and values as the model computes them.
    (["policy=kvgrad", "stage=decode"], "policy=kvgrad cannot run in stage=decode; use stage in ['prefill']"),
    (["policy=kvgrad", "policy.quantize=int8"], "KVgrad differentiates its replay passes"),
    (["policy=kvgrad", "policy.positions=reindex"], "stores altered: drop policy.positions"),
    (["policy=kvgrad", "policy.score.chunk=0"], "replay chunk=0 must be >= 1 token"),
    (
        ["policy=kvgrad", "stage=both"],
        "policy=h2o policy.prefill=kvgrad 'policy.allocation={kind:global,floor:0.0}'",
    ),
    (
        ["policy=kvzip", "policy.channels={kind:think,ratio:0.5}"],
        "policy=kvzip: channels chooses key channels from the prompt's last queries",
    ),
    (
        ["policy=profiled/headkv"],
        "allocation scores 'results/profile_example/tiny-llama/retrieval/retrieval_heads.json' is not a file",
    ),
    (
        ["policy=profiled/headkv", f"policy.allocation.scores={REFUSED / 'retrieval_heads_other_model.json'}"],
        "were measured on another-model (3 layers of 1 KV heads)",
    ),
    (
        [
            "policy=profiled/headkv",
            f"policy.allocation.scores={REFUSED / 'retrieval_heads_other_model.json'}",
            "policy.allocation.pool=1.5",
        ],
        "pool=1.5 must be in [0, 1]",
    ),
    (["policy=duoattention", "policy.score.head_ratio=1.5"], "head_ratio=1.5 must be in [0, 1]"),
    (["policy=duoattention", "policy.score.head_ratio=-0.1"], "head_ratio=-0.1 must be in [0, 1]"),
    (["policy=duoattention", "stage=both"], "policy=duoattention cannot run in stage=both; use stage in ['prefill']"),
]
MESSAGES: dict[str, tuple[int, str]] = {}  # command line -> (exit status, message), for the doc


@pytest.mark.parametrize("overrides, message", CASES, ids=[" ".join(c[0]).replace(f"{REPO}/", "") for c in CASES])
def test_bad_input_gets_one_message_and_no_model(cli, overrides, message):
    code, line = refuse(cli, overrides)
    assert code == 2
    assert message in line


def refuse(cli, overrides: list[str]) -> tuple[int, str]:
    """Run one refused command line; (exit status, its one kvbench line), remembered for the doc."""
    base = ["model=tiny-llama"] if any(o.startswith(("task=", "model=")) for o in overrides) else TINY
    code, err = cli(*base, *overrides)
    MESSAGES[" ".join(overrides)] = (code, one_message(err))
    return MESSAGES[" ".join(overrides)]


def test_a_phase_policy_that_is_not_a_config_lists_the_policies(cli):
    code, err = cli(*TINY, "stage=both", "policy=snapkv", "policy.decode=nope")
    line = one_message(err)
    assert code == 2 and "policy.decode=nope: 'nope' is not a policy; choose one of" in line
    assert all(name in line for name in ("h2o", "window", "snapkv"))


def test_a_task_scored_one_text_at_a_time_refuses_a_batch(cli):
    """Perplexity teacher-forces each text alone: a batch_size > 1 cell would label its timings a batch's."""
    code, err = cli("model=tiny-llama", "task=perplexity", f"task.data_dir={SHARED_DATA}/longbench", "batch_size=4")
    assert code == 2
    assert one_message(err) == (
        "kvbench: task=perplexity scores each text alone (teacher forcing), so batch_size=4 would label one "
        "sequence's timings as a batch's; use batch_size=1"
    )


def test_cuda_device_without_cuda(cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = cli(*TINY, "model.device=cuda")
    assert code == 2 and "model.device=cuda but CUDA is not available here" in one_message(err)


def test_wandb_online_without_credentials(cli, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    empty = tmp_path / "netrc"
    empty.write_text("machine example.org login x password y\n")
    monkeypatch.setenv("NETRC", str(empty))
    code, err = cli(*TINY, "tracking.wandb.mode=online")
    assert code == 2
    assert "tracking.wandb.mode=online needs credentials: run `wandb login` or set WANDB_API_KEY" in one_message(err)


def test_wandb_online_with_a_netrc_entry_passes_the_check(monkeypatch, tmp_path):
    from kvbench.tracking import check_credentials

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    path = tmp_path / "netrc"
    path.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    monkeypatch.setenv("NETRC", str(path))
    assert check_credentials("online") is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert "needs credentials" in check_credentials("online")


def test_a_sweep_with_an_unknown_option_runs_nothing(cli):
    """Hydra composes every cell of a sweep before it launches any, so a typo costs nothing."""
    code, err = cli("-m", *TINY, "policy=window,nope")
    assert code == 1 and "Could not find 'policy/nope'" in err


# ---------------------------------------------------------------- docs/refused_inputs.md


def test_refused_inputs_doc_is_current(cli):
    """docs/refused_inputs.md is this file's CASES with the messages they really get: it fails when the
    committed file differs, and rewrites it when KVBENCH_WRITE_DOCS=1. A list of registered names is shown as
    such, so adding a score (or any registered part) leaves the document as it is."""
    rows = []
    for overrides, _ in CASES:
        key = " ".join(overrides)
        code, message = MESSAGES[key] if key in MESSAGES else refuse(cli, overrides)
        shown = [o.replace(f"{REPO}/", "") for o in overrides]
        rows.append(f"| `kvbench-run {' '.join(shown)}` | {code} | {cell(generic(message.replace(f'{REPO}/', '')))} |")
    text = DOC_HEAD + "\n".join(rows) + "\n" + DOC_TAIL
    if os.environ.get("KVBENCH_WRITE_DOCS") == "1":
        DOC.write_text(text, encoding="utf-8")
    assert DOC.read_text(encoding="utf-8") == text, (
        f"{DOC.relative_to(REPO)} is stale: run KVBENCH_WRITE_DOCS=1 pytest tests/runner/test_validation.py -k doc "
        "and commit it"
    )


def generic(message: str) -> str:
    """``message`` with each registry's list of names replaced by what it lists (a registry of one name has no
    list: its name is a word of other messages too)."""
    for registry in registries():
        if len(registry.names()) > 1:
            message = message.replace(registry.choices(), f"<the registered {registry.what}s>")
    return message


def test_a_new_score_leaves_the_doc_as_it_is(cli):
    """The unknown-score message lists every score, the new one too; the document shows the list as a placeholder,
    so adding a score changes nothing there."""

    @register_score("doc_test_score")
    class DocTestScore(Score):
        def __call__(self, state):
            return state.positions.float()

    code, err = cli(*TINY, "policy=window", "policy.score=bogus")
    message = one_message(err)
    assert code == 2 and "doc_test_score" in message
    assert f"| {cell(generic(message))} |" in DOC.read_text(encoding="utf-8")


def cell(text: str) -> str:
    """Text inside a markdown table cell: pipes escaped, code spans kept literal."""
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


DOC_HEAD = """# Refused inputs

Every command line below is refused before any model weights load, with one line on stderr and exit status 2
(in a sweep, `-m`, the line goes to the cell's `error.txt` and the other cells run). Generated by
`tests/runner/test_validation.py` from the cases it checks; do not edit by hand: after changing a message, run
`KVBENCH_WRITE_DOCS=1 pytest tests/runner/test_validation.py -k doc` and commit the result. Each command ran after
`model=tiny-llama` (and, when it names neither a model nor a task, `task.n=2 task.context_tokens=128
task.max_new_tokens=4`), from the repository root. Where a message lists every registered score (quantiser, ...),
this page shows `<the registered scores>` instead, so adding one leaves the page as it is.

| command line | exit status | message |
|---|---|---|
"""

DOC_TAIL = """
Also refused, with messages that depend on the machine (checked by the same test file):
`model.device=cuda` where CUDA is not available, and `tracking.wandb.mode=online` without wandb credentials.
Hydra itself refuses, with exit status 1 and its own message, an unknown option of a config group
(`policy=nope`: it lists the available ones), an unknown key (`budgett=0.5`: `Key 'budgett' is not in struct`)
and a malformed override; in a sweep it does so before any cell runs.
"""


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=perplexity"], "task=perplexity gives no question apart from its context"),
        (
            ["task=longbench", "task.ask=each", "task.question_aware=false"],
            "task=longbench compresses one context for several questions; use task.ask=all",
        ),
    ],
)
def test_finch_is_refused_where_a_task_gives_no_question_of_its_own(cli, overrides, message):
    code, err = cli("model=tiny-llama", "policy=finch", *overrides, f"task.data_dir={SHARED_DATA}/longbench")
    line = one_message(err)
    assert code == 2 and "policy=finch observes the prompt's question" in line and message in line, line


def test_finch_passes_where_the_task_feeds_its_question_apart():
    """The refusals above are Finch's only: the same cell with the question fed apart validates."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = compose("config", overrides=[*TINY, "policy=finch", "task.question_aware=false"])
    assert validate(config).policy.question


def test_finch_is_refused_for_a_harness_that_brings_its_own_requests():
    """lm-eval's requests come whole, with no question apart: the engine-only check refuses Finch, before weights."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = compose("config", overrides=[*TINY, "policy=finch"])
    with pytest.raises(ConfigError, match="a harness's own requests do not give apart from the context"):
        validate_engine(config)


PROMPT_ONLY = sorted(
    p.stem
    for p in (REPO / "configs" / "policy").glob("*.yaml")
    if "both" in str(build_policy_named(p.stem).unsupported_stages or ())
    and "prefill" not in str(build_policy_named(p.stem).unsupported_stages or ())
)


# Prompt-only policies no named decode policy pairs with (their refusal names no decode phase).
NO_DECODE_PAIR = {"cake"}  # its layer budgets need a windowed score, and no named decode-phase policy has one


@pytest.mark.parametrize("name", PROMPT_ONLY)
def test_the_decode_phase_hint_of_a_prompt_only_policy_validates(name):
    """A prompt-only policy refused in stage=both names a decode phase that works: its overrides validate."""
    task = ["task.question_aware=false"]  # Finch's question apart; the others do not mind
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        config = compose("config", overrides=[*TINY, *task, f"policy={name}", "stage=both"])
        with pytest.raises(ConfigError) as refused:
            validate(config)
        if "decode phase: " not in str(refused.value):
            assert name in NO_DECODE_PAIR, str(refused.value)
            return
        hint = shlex.split(str(refused.value).split("decode phase: ", 1)[1].rsplit(")", 1)[0])
        base = next((o for o in hint if o.startswith("policy=")), f"policy={name}")
        overrides = [o for o in hint if not o.startswith("policy=")]
        config = compose("config", overrides=[*TINY, *task, base, *overrides, "stage=both"])
    assert str(validate(config).stage) in ("both", "Stage.both")
