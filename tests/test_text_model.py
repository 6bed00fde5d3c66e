"""`oda text-model`: the text model of a multimodal checkpoint, saved as a text-only causal LM folder that ODA (and its
vLLM plugin) load; its logits equal the multimodal model's on text."""

import json

import pytest
import torch
import transformers

from cli_harness import run_oda
from oda_hf import OdaForCausalLM
from oda_hf.vllm import oda_architecture
from tiny_models import save_word_tokenizer

VOCAB = 300


def qwen3_5_vision_language():
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
                linear_num_value_heads=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2)
    return transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                    vision_config=vision))


def gemma3_vision_language():
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))


@pytest.mark.parametrize("build,architecture,served_as,dtype", [
    (qwen3_5_vision_language, "Qwen3_5ForCausalLM", "OdaQwen3_5ForCausalLM", torch.float32),
    (qwen3_5_vision_language, "Qwen3_5ForCausalLM", "OdaQwen3_5ForCausalLM", torch.bfloat16),
    (gemma3_vision_language, "Gemma3ForCausalLM", "OdaGemma3ForCausalLM", torch.float32)])
def test_text_model_of_a_vision_language_checkpoint(tmp_path, capsys, build, architecture, served_as, dtype):
    torch.manual_seed(0)
    source, output = tmp_path / "vl", tmp_path / "text"
    build().to(dtype).save_pretrained(source)
    save_word_tokenizer(source, VOCAB)
    # Loaded back as a user has it (a cast in memory also rounds rotary buffers the checkpoint does not hold).
    whole = type(build()).from_pretrained(source, dtype="auto").eval()
    code, err = run_oda(["text-model", source, output], capsys)
    assert code == 0, err
    assert json.loads((output / "config.json").read_text())["architectures"] == [architecture]
    assert (output / "tokenizer.json").is_file()
    text = transformers.AutoModelForCausalLM.from_pretrained(output, dtype="auto").eval()
    assert type(text).__name__ == architecture and text.dtype == dtype
    assert not any("visual" in name or "vision" in name for name, _ in text.named_parameters())
    ids = torch.randint(3, VOCAB - 3, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(text(ids).logits, whole(input_ids=ids).logits)
    assert oda_architecture(str(output)) == served_as   # what ODA's vLLM plugin serves
    oda = OdaForCausalLM.from_pretrained(output, policy="local")
    assert type(oda.base_model).__name__ == architecture
    assert [p.name for p in tmp_path.iterdir()] and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_text_model_refusals(tmp_path, capsys):
    torch.manual_seed(0)
    source = tmp_path / "vl"
    qwen3_5_vision_language().save_pretrained(source)
    code, err = run_oda(["text-model", tmp_path / "missing", tmp_path / "out"], capsys)
    assert code == 2 and "has no config.json" in err
    code, err = run_oda(["text-model", source, tmp_path / "text"], capsys)
    assert code == 0, err
    assert not (tmp_path / "text" / "tokenizer.json").exists()  # none invented (transformers would make an empty one)
    code, err = run_oda(["text-model", source, tmp_path / "text"], capsys)
    assert code == 2 and "already holds a model" in err
    code, err = run_oda(["text-model", tmp_path / "text", tmp_path / "again"], capsys)
    assert code == 2 and "text-only already" in err


def test_a_rerun_after_a_killed_conversion_is_refused_or_cleaned(tmp_path, capsys):
    """Found by an audit: a run killed while publishing leaves every file but config.json; the rerun was accepted and
    kept the old weight files beside the new ones (a stale sharded set with its index, which vLLM reads: another
    model's logits, exit 0). A folder holding files is now refused, naming them, and nothing in it is touched; the
    killed run's staging folder beside it goes. A processor-level chat template is carried."""
    torch.manual_seed(0)
    source, output = tmp_path / "vl", tmp_path / "text"
    gemma3_vision_language().save_pretrained(source)
    processor_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_word_tokenizer(source, VOCAB)
    config = json.loads((source / "tokenizer_config.json").read_text())   # the template only at processor level
    config.pop("chat_template", None)
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    (source / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    assert transformers.AutoTokenizer.from_pretrained(source).chat_template is None
    output.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (output / name).write_text("left by a killed run")
    code, err = run_oda(["text-model", source, output], capsys)
    assert code == 2 and "is not empty (model-00001-of-00002.safetensors, model.safetensors.index.json" in err
    assert sorted(p.name for p in output.iterdir()) == ["model-00001-of-00002.safetensors",
                                                        "model.safetensors.index.json"]
    for path in output.iterdir():
        path.unlink()
    (tmp_path / ".text.partial-abc").mkdir()
    (tmp_path / ".text.partial-abc" / "model.safetensors").write_text("half written")
    code, err = run_oda(["text-model", source, output], capsys)
    assert code == 0, err
    assert not (tmp_path / ".text.partial-abc").exists()
    assert transformers.AutoTokenizer.from_pretrained(output).chat_template == processor_template   # the processor's


def test_a_text_path_that_differs_is_one_line(tmp_path, capsys):
    """Gemma 3's multimodal class does not apply final_logit_softcapping, its text class does: refused in one line with
    exit 2 (it was a traceback), nothing kept."""
    torch.manual_seed(0)
    source = tmp_path / "vl"
    model = gemma3_vision_language()
    model.config.text_config.final_logit_softcapping = 30.0
    model.save_pretrained(source)
    code, err = run_oda(["text-model", source, tmp_path / "text"], capsys)
    assert code == 2 and "logits differ" in err and "Traceback" not in err
    assert not (tmp_path / "text").exists()   # nothing kept: not even the folder and its lock
