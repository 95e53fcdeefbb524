"""Bad input to ``kvbench-lm-eval`` / ``--model kvbench`` is refused with one message naming the fix, before any
weights load."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from lm_eval_runs import kvbench_lm

from kvbench.config import ConfigError
from kvbench.lm_eval import cli
from kvbench.lm_eval.requests import decode_settings, repeat_seeds


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the model loads."""
    from kvbench.runner import model_cache

    def refuse(*_: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_cache, "get_model", refuse)


@pytest.mark.parametrize(
    ("model_args", "words"),
    [
        ({"policy": "nope"}, "choose one of"),
        ({"dtype": "float32"}, "model.dtype=float32"),
        ({"budget": 2.0}, "budget=2.0"),
        ({"policy": "snapkv", "stage": "decode"}, "stage in"),
        ({"task": "niah"}, "--tasks"),
        ({"max_new_tokens": 8}, "max_gen_toks"),
        ({"sampling.do_sample": True}, "--gen_kwargs"),
        ({"batch_size": "auto"}, "give a number"),
    ],
)
def test_bad_model_args_are_refused_before_the_model_loads(model_args: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("[", r"\[")):
        kvbench_lm(**model_args)


def test_the_batch_size_is_given_once() -> None:
    from kvbench.lm_eval.model import KvbenchLM

    with pytest.raises(ConfigError, match="give the batch size once"):
        KvbenchLM.create_from_arg_obj({"model": "smollm2-135m", "batch_size": 8}, {"batch_size": "4"})


def test_the_command_refuses_bad_settings_with_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kvbench-lm-eval"])  # the command hands lm-eval its own argv
    argv = ["--model", "kvbench", "--model_args", "model=smollm2-135m,policy=nope", "--tasks", "niah_single_1"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench: ") and "snapkv" in err


def test_a_task_lm_eval_does_not_know_is_one_message_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kvbench-lm-eval"])
    argv = ["run", "--model", "kvbench", "--model_args", "model=tiny-llama", "--tasks", "no_such_task"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench-lm-eval: lm-eval has no task no_such_task") and "ls tasks" in err


def test_without_lm_eval_the_command_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kvbench-lm-eval"])
    monkeypatch.setitem(sys.modules, "lm_eval._cli", None)  # import lm_eval._cli raises ImportError
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", "kvbench", "--tasks", "niah_single_1"])
    assert exit_.value.code == 2
    assert "pip install 'kvbench[lm-eval]'" in capsys.readouterr().err


def test_gen_kwargs_the_decoder_has_not_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        decode_settings({"until": ["\n"], "do_sample": True, "temperature": 0.7, "top_k": 5}, 32, "</s>", 0)


def test_gen_kwargs_become_the_decoders_settings() -> None:
    settings, until = decode_settings(
        {"until": ["\n\n"], "max_gen_toks": 7, "do_sample": True, "temperature": 0.5, "top_p": 0.9}, 32, "</s>", 3
    )
    assert (settings.max_new_tokens, settings.do_sample, settings.temperature, settings.top_p) == (7, True, 0.5, 0.9)
    assert settings.seed == 3 and until == ["\n\n", "</s>"] and settings.stop_strings == ["\n\n", "</s>"]
    greedy, _ = decode_settings({"temperature": 0.0}, 32, "</s>", 0)
    assert (greedy.do_sample, greedy.max_new_tokens) == (False, 32)


def test_each_repeat_samples_from_its_own_seed() -> None:
    first, second = object(), object()
    assert repeat_seeds([first, first, first, second, second], 10) == [10, 11, 12, 10, 11]


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"policy": "snapkv", "budget": 0.5, "stage": "prefill"}, "compress nothing"),
        ({"policy": "h2o", "budget": 0.5, "stage": "both"}, "a share of that one token"),
        ({"policy": "h2o", "budget": 0.5, "stage": "decode"}, None),
        ({"policy": "h2o", "budget": 256, "stage": "both"}, None),
        ({"policy": "full"}, None),
        ({"policy": "snapkv", "budget": 1.0, "stage": "prefill"}, None),  # a method's keep-all reference
        ({"policy": "snapkv", "budget": 256, "stage": "prefill"}, "compress nothing"),
    ],
)
def test_rolling_perplexity_is_refused_where_the_budget_would_mean_nothing(settings: dict, refused: str | None) -> None:
    """A rolling window is one token of prompt and the text teacher-forced after it: compressing the prompt, or a
    fraction of it, would report the full cache's perplexity (or one token's) under the policy's name."""
    from kvbench.lm_eval.model import KvbenchLM
    from kvbench.lm_eval.settings import run_spec

    lm = KvbenchLM.__new__(KvbenchLM)  # the settings alone: no weights
    lm.spec = run_spec({"model": "smollm2-135m", **settings})
    if refused is None:
        lm._check_rolling()
        return
    with pytest.raises(ConfigError, match=refused) as error:
        lm.loglikelihood_rolling([])
    assert "stage=decode" in str(error.value)


def test_what_the_models_config_refuses_is_refused_before_the_weights_load() -> None:
    """kvbench-run refuses a per-layer budget list of another length than the model's layers from its config;
    so does the lm-eval model (the autouse fixture fails the test if the weights load)."""
    with pytest.raises(ConfigError, match="allocation=layers lists 2 budgets"):
        kvbench_lm(policy="layers_snapkv", **{"policy.allocation.budgets": "[0.5,0.5]"})
