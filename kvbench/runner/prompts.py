"""Every prompt of a cell rendered with the tokenizer alone, and refused before any weights load when the task
refuses it (``TaskError``), when it is not the shape the task's protocol feeds, when the model cannot hold it, or
when the budget cannot protect what the policy always keeps."""

from __future__ import annotations

from kvbench.budget import budget_tokens, too_small
from kvbench.config import ConfigError, RunSpec
from kvbench.engine.sequence import reference_length
from kvbench.families import policy_problem
from kvbench.models import load_config, load_tokenizer
from kvbench.tasks.base import Example, RenderedPrompt, Task, TaskError
from kvbench.tasks.protocol import SharedContextPrompt


def longest_suffix(prompt: RenderedPrompt) -> int:
    """Tokens fed after the compressed context: the suffix, or the longest of one context's questions."""
    if isinstance(prompt, SharedContextPrompt):
        return max((len(q) for q in prompt.questions), default=0)
    return len(prompt.suffix_ids)


def check_model_support(spec: RunSpec) -> None:
    """Refuse from the model's config alone (no weights) what kvbench cannot run exactly on it."""
    problem = policy_problem(load_config(**spec.model), spec.policy)
    if problem:
        raise ConfigError(f"model={spec.model['name']}: {problem}")


def render_all(task: Task, examples: list[Example], spec: RunSpec) -> dict[str, RenderedPrompt]:
    """Each example's prompt by id; a context the model cannot hold, or a budget below what the policy always
    protects, is a ``ConfigError`` naming the fix."""
    check_model_support(spec)
    tokenizer, limit = load_tokenizer(**spec.model)
    asked = task.asked_length()
    if limit and asked and asked > limit:
        raise ConfigError(
            f"task={task.name}: task.context_tokens={asked} is longer than model={spec.model['name']} can hold "
            f"({limit} tokens); lower task.context_tokens"
        )
    rendered = {}
    for ex in examples:
        try:
            prompt = task.render(ex, tokenizer)
        except TaskError as err:
            raise ConfigError(f"task={task.name}: example {ex.id}: {err}") from err
        if not isinstance(prompt, task.protocol.prompt):
            raise ConfigError(
                f"task={task.name}: render returned a {type(prompt).__name__}; its protocol "
                f"{task.protocol.name!r} needs a {task.protocol.prompt.__name__}"
            )
        if isinstance(prompt, SharedContextPrompt) and (not ex.questions or len(prompt.questions) != len(ex.questions)):
            raise ConfigError(
                f"task={task.name}: example {ex.id} has {len(ex.questions)} questions but render gave "
                f"{len(prompt.questions)}; a shared context asks one or more, each rendered"
            )
        new_tokens = spec.max_new_tokens or task.generation(ex).max_new_tokens
        suffix = longest_suffix(prompt)
        total = len(prompt.input_ids) + suffix + new_tokens
        if limit and total > limit:
            raise ConfigError(
                f"example {ex.id}: {total} tokens (prompt + max_new_tokens) exceed the model's limit of {limit}; "
                "lower the task's context length or set task.max_prompt_tokens to truncate"
            )
        if spec.policy.evicts:
            reference = reference_length(spec.stage, len(prompt.input_ids), suffix, new_tokens)
            problem = too_small(budget_tokens(spec.budget, reference), spec.policy)
            if problem:
                raise ConfigError(f"example {ex.id}: budget={spec.budget} of its {reference} tokens: {problem}")
        rendered[ex.id] = prompt
    return rendered
