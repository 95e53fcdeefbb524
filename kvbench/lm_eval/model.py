"""kvbench as an lm-eval model (``--model kvbench``): every lm-eval request runs through kvbench's engine under the
policy, budget and stage of ``--model_args``.

``generate_until`` decodes with the task's stop sequences, ``max_gen_toks`` and sampling settings (each repeat
from its own seed); ``loglikelihood`` and ``loglikelihood_rolling`` teacher-force the continuation through the
budgeted cache, as kvbench's perplexity does: the context is prefilled (and compressed for stage=prefill or
both), the continuation fed one token at a time. Tokenisation, truncation and the cut at stop sequences follow
lm-eval's ``hf`` model, so that with ``policy=full`` the two give the same answers. Each request's measures go
into lm-eval's per-sample log (``requests.attach``).

Importing this module registers the model with lm-eval under the name ``kvbench``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import postprocess_generated_text, resolve_max_length
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from kvbench.config import ConfigError
from kvbench.engine.attention import kvbench_attention_enabled
from kvbench.engine.engine import Generation, Request
from kvbench.lm_eval import requests as convert
from kvbench.lm_eval.settings import run_spec
from kvbench.runner import model_cache
from kvbench.runner.passes import run_engine
from kvbench.runner.prompts import check_model_support

DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf model's, where neither config nor tokenizer says
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model's, where a task does not say


def device_available(device: str) -> bool:
    """Whether this machine has ``device``: lm-eval's ``--device`` defaults to cuda:0, and like lm-eval's ``hf``
    model kvbench then runs where it can (``model.device=auto``) instead of refusing."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        return torch.cuda.is_available() and int(index or 0) < torch.cuda.device_count()
    if kind == "mps":
        return bool(torch.backends.mps.is_available())
    return kind == "cpu"


@register_model("kvbench")
class KvbenchLM(TemplateLM):
    """A kvbench model under one policy. ``model_args``: kvbench's config overrides (``settings.run_spec``);
    ``device`` (lm-eval's ``--device``) sets ``model.device`` where this machine has it; ``tokenizer`` is read by
    lm-eval's synthetic tasks (RULER) to size their prompts and is not used here; ``max_length`` caps what a
    request feeds, as in lm-eval's ``hf`` model."""

    def __init__(
        self,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        tokenizer: str | None = None,
        max_length: int | None = None,
        **model_args: Any,
    ) -> None:
        super().__init__()
        if batch_size is not None:
            if not str(batch_size).isdigit():
                raise ConfigError(
                    f"batch_size={batch_size} is lm-eval's search for the largest batch; kvbench decodes a fixed "
                    "batch: give a number (--model_args batch_size=8)"
                )
            model_args["batch_size"] = int(batch_size)
        if device is not None and "model.device" not in model_args:
            model_args["model.device"] = device if device_available(device) else "auto"
        self.spec = run_spec(model_args)  # every setting checked before the weights load
        check_model_support(self.spec)  # and what the model's config alone refuses (a per-layer list's length)
        self.lm = model_cache.get_model(self.spec.model)
        self.tokenizer = self.lm.tokenizer
        self._device = self.lm.device
        self._rank, self._world_size = 0, 1
        self._max_length = max_length
        self._measures: list[dict[str, Any]] = []  # the last _loglikelihood_tokens call's, in request order

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> KvbenchLM:
        """``--model_args`` with lm-eval's ``--batch_size``/``--device``; a ``batch_size`` in ``--model_args`` wins
        over lm-eval's default of 1."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> KvbenchLM:
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "batch_size" in arg_dict and str(given.get("batch_size", 1)) not in ("1", str(arg_dict["batch_size"])):
            raise ConfigError(
                f"--batch_size {given['batch_size']} and --model_args batch_size={arg_dict['batch_size']}: "
                "give the batch size once"
            )
        return cls(**{**given, **arg_dict})

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS where the tokenizer has one, else EOS."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        return int(resolve_max_length(self.lm.model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH))

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own special tokens unless told, and none added to a string that starts with BOS."""
        if add_special_tokens is None and self.tokenizer.bos_token and string.startswith(self.tokenizer.bos_token):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **options))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )
        )

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        seeds = convert.repeat_seeds(requests, self.spec.seed)
        batch, stops = [], []
        for request, seed in zip(requests, seeds):
            context, gen_kwargs = request.args[0], request.args[1]
            settings, until = convert.decode_settings(gen_kwargs, DEFAULT_MAX_GEN_TOKS, eos, seed)
            room = self.max_length - settings.max_new_tokens
            if room <= 0:
                raise ValueError(f"max_gen_toks={settings.max_new_tokens} leaves no room in {self.max_length} tokens")
            batch.append(Request(self.tok_encode(context)[-room:], settings=settings))
            stops.append(until)
        generations = self._run(batch, return_logits=False, desc="generate_until", disable=disable_tqdm)
        texts = []
        for g, until in zip(generations, stops):
            text = self.tokenizer.decode(g.tokens, skip_special_tokens=True)
            texts.append(postprocess_generated_text(text, until, None))
        self._log(requests, [convert.logged(g.measures) for g in generations])
        return texts

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._log(requests, self._measures)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text in lm-eval's disjoint windows of ``max_length`` tokens, every window teacher-forced."""
        self._check_rolling()
        windows, owner = [], []
        for index, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append((None, *make_disjoint_window(window)))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        measures: list[list[dict[str, Any]]] = [[] for _ in requests]
        for index, (logprob, _), measure in zip(owner, scores, self._measures):
            totals[index] += logprob
            measures[index].append(measure)
        self._log(requests, measures)
        return totals

    def _check_rolling(self) -> None:
        """A rolling window is one token of prompt and the whole text teacher-forced after it: compressing the prompt
        (stage=prefill) compresses nothing, and a fractional budget under stage=both is a share of that one token.
        Refused, naming the settings that measure something."""
        spec = self.spec
        keeps_all = isinstance(spec.budget, float) and spec.budget >= 1.0  # the reference run of a method
        if not spec.policy.evicts or keeps_all or spec.stage == "decode":
            return
        if spec.stage == "both" and isinstance(spec.budget, int):
            return
        raise ConfigError(
            f"loglikelihood_rolling (perplexity) feeds each text after one token of prompt, so stage={spec.stage} "
            f"with budget={spec.budget} would "
            + ("compress nothing" if spec.stage == "prefill" else "hold a share of that one token")
            + "; use stage=decode (the budget a share of the text) or stage=both with a token budget (budget=256)"
        )

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_: Any
    ) -> list[tuple[float, bool]]:
        batch, targets = [], []
        for _, context, continuation in requests:
            prompt, scored = convert.forced_window(context, continuation, self.max_length)
            settings = convert.DecodeSettings(max_new_tokens=len(scored), seed=self.spec.seed)
            batch.append(Request(prompt, settings=settings, forced_tokens=scored))
            targets.append(scored)
        generations = self._run(batch, return_logits=True, desc="loglikelihood", disable=disable_tqdm)
        self._measures = [convert.logged(g.measures) for g in generations]
        return [convert.scored(g, t) for g, t in zip(generations, targets)]

    def _run(self, batch: list[Request], *, return_logits: bool, desc: str, disable: bool) -> list[Generation]:
        """Every request through the engine under the run's policy, with a progress bar; the first error raised."""
        engine = run_engine(self.lm, self.spec, self.spec.batch_size, return_logits=return_logits)
        out: list[Generation | None] = [None] * len(batch)
        with kvbench_attention_enabled(self.lm.model), tqdm(total=len(batch), desc=desc, disable=disable) as bar:
            for finished in engine.steps(batch):
                for index, result in finished:
                    if isinstance(result, Exception):
                        raise result
                    out[index] = result
                    bar.update()
        return [g for g in out if g is not None]

    def _log(self, requests: list[Any], measures: Sequence[Any]) -> None:
        """The measures into lm-eval's per-sample log, unless lm-eval caches responses (``--use_cache``): it keys
        its cache on the logged arguments, which must then stay as they were."""
        hook = getattr(self, "cache_hook", None)
        if getattr(hook, "dbdict", None) is None:
            convert.attach(requests, measures)
