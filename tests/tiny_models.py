"""Tiny random models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def _config(family: str, **overrides):
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, **COMMON)
    elif family == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=None, **COMMON)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(num_hidden_layers=2, **COMMON)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(num_hidden_layers=2, head_dim=8, **COMMON)
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            num_hidden_layers=4, head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
            linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, **COMMON)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            num_hidden_layers=4, head_dim=8, sliding_window=5, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=8, **COMMON)
    elif family == "gemma4":
        cfg = transformers.Gemma4TextConfig(
            num_hidden_layers=4, head_dim=8, global_head_dim=8, sliding_window=5, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, **COMMON)
    else:
        raise KeyError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma3", "gemma4"]
CAUSAL_LM = {
    "llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
    "qwen3_5": transformers.Qwen3_5ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM,
    "gemma4": transformers.Gemma4ForCausalLM,
}


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    torch.manual_seed(seed)
    config = _config(family, **overrides)
    config._attn_implementation = attn_implementation
    model = CAUSAL_LM[family](config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy paths are stable under fp noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def left_padded_prompts(batch: int = 2, length: int = 9, pads=(3, 0), seed: int = 3):
    """Random prompt ids and an attention mask with `pads[row]` left-padding positions per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def save_with_word_tokenizer(model, folder) -> None:
    """Save `model` with a word-level tokenizer over its vocabulary ("w3" .. "w96", specials 0-2, no chat
    template), so CLI tests can load both from one folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(folder)
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(folder)


def save_word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer over a tiny vocabulary ("w3" .. "w<vocab_size - 1>"; 0-2 special) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
