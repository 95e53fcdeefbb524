"""The engine and the capacity probes on CUDA: the tiny random Llama in float32 on the device.

- Every named policy at a budget of at least the sequence gives transformers' own ``generate`` greedy tokens.
- A batch of 3 gives each sequence what it gives alone (``test_batches``' tolerance).
- ``capacity.probe`` reports the device's peak (``max_memory_allocated``: weights included), a batch over a
  cap does not fit, and an out-of-memory error inside a probe is a probe that does not fit (the process goes on).

Marked ``gpu``: skipped where torch sees no CUDA. ``KVBENCH_TEST_DEVICE=cpu`` runs the same checks on the CPU
(a dry run of their logic on a machine without a GPU; the device-only assertions are then left out).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import keeping_all, tiny_policy_cfg
from engine_run import generate
from test_batches import NAMED, check_batch, named, requests

from kvbench.capacity import largest_batch, probe
from kvbench.engine.attention import ATTN_NAME
from kvbench.engine.cache import store
from kvbench.engine.engine import DecodeSettings
from kvbench.models import LoadedModel, load_model
from kvbench.policies.registry import build_policy

DEVICE = torch.device(os.environ.get("KVBENCH_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"
pytestmark = [pytest.mark.usefixtures("one_thread")] + ([pytest.mark.gpu] if ON_CUDA else [])
PROMPT, NEW, STRIDE = 48, 12, 8
LOGIT_TOL = 1e-4  # of the largest logit: a chunked prefill and generate's one pass use different kernels
CASES = [(n, s) for n in NAMED for s in ("prefill", "decode", "both") if s not in named(n).unsupported_stages]


@pytest.fixture(scope="module")
def device_tiny() -> LoadedModel:
    lm = load_model("tiny-llama", source="tiny", dtype="float32", device=str(DEVICE))
    lm.model.generation_config.eos_token_id = None  # never stop early: every run gives its max_new_tokens
    return lm


@pytest.fixture(scope="module")
def hf_reference(device_tiny) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' greedy ``generate`` on the device: the prompt, its tokens and their logits."""
    ids = torch.randint(0, 250, (PROMPT,), generator=torch.Generator().manual_seed(12)).tolist()
    out = device_tiny.model.generate(
        torch.tensor([ids], device=DEVICE),
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return ids, out.sequences[0, PROMPT:].tolist(), torch.stack(out.logits)[:, 0].float().cpu()


def top2_gaps(logits: torch.Tensor) -> list[float]:
    """Per step, how far the greedy token's logit is ahead of the next one (a tie explains a differing token)."""
    top2 = logits.topk(2).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("name, stage", CASES)
def test_budget_at_least_length_equals_generate(device_tiny, hf_reference, name, stage):
    ids, ref_tokens, ref_logits = hf_reference
    g = generate(
        device_tiny.model,
        None,
        ids,
        build_policy(keeping_all(tiny_policy_cfg(name))),
        PROMPT + NEW,
        stage,
        DecodeSettings(max_new_tokens=NEW),
        stride=STRIDE,
        return_logits=True,
    )
    assert g.logits is not None
    assert g.logits.device.type == "cpu" and device_tiny.model.device.type == DEVICE.type
    assert g.tokens == ref_tokens, f"{name} {stage}: generate's top-2 logit gaps {top2_gaps(ref_logits)}"
    torch.testing.assert_close(g.logits, ref_logits, rtol=0, atol=LOGIT_TOL * float(ref_logits.abs().max()))


@pytest.mark.parametrize("fused", [True, False])
def test_the_fused_and_the_modules_forward_both_equal_generate(device_tiny, hf_reference, fused):
    """The default is the fused forward on CPU and the model's modules on CUDA; each, asked for, is exact."""
    ids, ref_tokens, ref_logits = hf_reference
    g = generate(
        device_tiny.model,
        None,
        ids,
        named("h2o"),
        PROMPT + NEW,
        "both",
        DecodeSettings(max_new_tokens=NEW),
        stride=STRIDE,
        return_logits=True,
        fused=fused,
    )
    assert g.tokens == ref_tokens
    assert g.logits is not None
    torch.testing.assert_close(g.logits, ref_logits, rtol=0, atol=LOGIT_TOL * float(ref_logits.abs().max()))


@pytest.mark.parametrize("name", NAMED)
def test_a_batch_of_three_equals_each_sequence_alone(device_tiny, name):
    policy = named(name)
    # a policy observing the question (Finch) gets one, and the prompt with it in one step
    reqs = requests(lengths=(40, 25, 33, 50), news=(12, 5, 9, 12), question=4 if policy.question else 0)
    stride = None if policy.question else 8
    for stage in [s for s in ("prefill", "decode", "both") if s not in policy.unsupported_stages]:
        out = check_batch(device_tiny.model, reqs, policy, 0.4, stage, batch_size=3, stride=stride, heads=2)
        if policy.evicts:
            assert any(g.measures.budget_achieved < 0.99 for g in out), (name, stage)
        assert max(s for g in out for s in g.decode_batch_sizes) == 3


@pytest.mark.parametrize(
    "extra",
    [{"merge": True}, {"quantize": "int8"}, {"quantize": "fp8"}, {"positions": "reindex"}],
    ids=["merge", "int8", "fp8", "reindex"],
)
def test_extras_batched_equal_alone(device_tiny, extra):
    reqs = requests(lengths=(40, 25, 33, 50), news=(12, 5, 9, 12), ids_seed=1)
    check_batch(device_tiny.model, reqs, named("h2o", **extra), 0.4, "both", batch_size=3, stride=8, heads=2)


def probe_requests() -> list:
    return requests(lengths=(96, 80, 64), news=(8, 8, 8))


def test_probe_reports_the_device_peak_and_a_batch_over_the_cap_does_not_fit(device_tiny):
    model, reqs = device_tiny.model, probe_requests()
    roomy = probe(model, reqs, named("h2o"), 0.5, "both", 2, cap_bytes=1 << 50)
    assert roomy.fits and roomy.error is None and roomy.decode_tokens_per_s and roomy.kv_resident_bytes
    if ON_CUDA:
        assert roomy.memory_kind == "cuda_max_allocated"
        # The probe reset the device's counter as it began; nothing was allocated after it ended.
        assert roomy.peak_memory_bytes == torch.cuda.max_memory_allocated(DEVICE)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert roomy.peak_memory_bytes >= weights + roomy.kv_resident_bytes
    tight = probe(model, reqs, named("h2o"), 0.5, "both", 2, cap_bytes=1)
    assert not tight.fits and tight.error is None and tight.peak_memory_bytes > 1


@pytest.mark.skipif(not ON_CUDA, reason="the resident set of a CPU run is too noisy to bracket one batch")
def test_largest_batch_under_a_cap_between_two_batches(device_tiny):
    model, reqs = device_tiny.model, probe_requests()
    peaks = {b: probe(model, reqs, named("full"), 1.0, "both", b, 1 << 50).peak_memory_bytes for b in (1, 2, 3)}
    assert peaks[1] < peaks[2] < peaks[3], peaks  # the batch's rows grow with it
    cap = (peaks[2] + peaks[3]) // 2
    best, probes = largest_batch(lambda b: probe(model, reqs, named("full"), 1.0, "both", b, cap), limit=8)
    assert best == 2 and [p.batch for p in probes] == [1, 2, 4, 3]
    assert [p.fits for p in probes] == [True, True, False, False]


def exhaust_the_device() -> None:
    """Ask for far more memory than the device holds (on CPU: raise what CUDA would raise)."""
    if ON_CUDA:
        torch.empty(1 << 50, dtype=torch.uint8, device=DEVICE)  # 1 PiB
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. (raised for a CPU dry run)")


def test_out_of_memory_inside_a_probe_is_a_probe_that_does_not_fit(device_tiny, monkeypatch):
    """The error comes from the cache's first allocation, mid-forward; the probe says the batch does not fit,
    frees what the run held, restores the model's attention, and the next probe runs."""
    model, reqs = device_tiny.model, probe_requests()
    # First a run that leaves allocated what stays for good (the BLAS workspace; on CPU the fused weights).
    assert probe(model, reqs, named("h2o"), 0.5, "both", 2, cap_bytes=1 << 50).fits
    before = torch.cuda.memory_allocated(DEVICE) if ON_CUDA else 0
    original = store.KVStore.__init__

    def failing(self, *args, **kwargs):
        exhaust_the_device()
        original(self, *args, **kwargs)

    monkeypatch.setattr(store.KVStore, "__init__", failing)
    failed = probe(model, reqs, named("h2o"), 0.5, "both", 2, cap_bytes=1 << 50)
    assert not failed.fits and failed.error is not None and failed.error.startswith("OutOfMemoryError: ")
    assert failed.decode_tokens_per_s is None and failed.kv_resident_bytes is None
    assert model.config._attn_implementation != ATTN_NAME
    if ON_CUDA:
        assert failed.memory_kind == "cuda_max_allocated" and failed.peak_memory_bytes >= before
        assert torch.cuda.memory_allocated(DEVICE) == before  # nothing of the failed run is still held
    monkeypatch.setattr(store.KVStore, "__init__", original)
    again = probe(model, reqs, named("h2o"), 0.5, "both", 2, cap_bytes=1 << 50)
    assert again.fits and again.error is None


@pytest.mark.skipif(not ON_CUDA, reason="a real out-of-memory needs the device's allocator")
def test_a_request_larger_than_the_device_does_not_fit(device_tiny):
    """Decode rows for more tokens than the device holds: the real allocator's error, caught by the probe."""
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    huge = requests(lengths=(32,), news=(4 * total // 1024,))  # the tiny model's K/V: about 1 KiB a token
    failed = probe(device_tiny.model, huge, named("full"), 1.0, "both", 1, cap_bytes=1 << 50)
    assert not failed.fits and failed.error is not None and "out of memory" in failed.error.lower()
    again = probe(device_tiny.model, probe_requests(), named("full"), 1.0, "both", 1, cap_bytes=1 << 50)
    assert again.fits
