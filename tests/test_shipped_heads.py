"""The recall heads shipped in the package: complete, calibrated on dev, loadable by their short names.

The bases are not downloaded here: a random model with the base's shapes (one layer) stands in for each, which
checks that the head attaches and routes; their quality is measured in benchmarks/results/.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from oda_hf import OdaForCausalLM, RecallHead
from oda_hf.known_models import resolve_head

# name: (hidden size, vocabulary, sinks, window, the first test length of its card's table)
SHIPPED = {"smollm2": (576, 49152, 4, 256, 2048), "gemma3-270m": (640, 262144, 4, 512, 4096),
           "qwen2.5-coder-0.5b": (896, 151936, 4, 256, 4096)}
shipped = pytest.mark.parametrize("name", sorted(SHIPPED))


@shipped
def test_shipped_head_is_complete_and_names_its_base(name):
    folder = resolve_head(name)
    for file in ("config.json", "model.safetensors", "oda_config.json", "calibration.json", "README.md"):
        assert os.path.isfile(os.path.join(folder, file)), file
    head = RecallHead.from_pretrained(folder)
    hidden, vocab, sinks, window, _ = SHIPPED[name]
    assert head.config.base_model_name_or_path == name and head.config.base_fingerprint.startswith("sha256:")
    assert (head.config.hidden_size, head.config.base_vocab_size) == (hidden, vocab)
    assert (head.config.sinks, head.config.window) == (sinks, window)
    assert all(torch.isfinite(p).all() for p in head.parameters())


@shipped
def test_shipped_threshold_is_the_dev_calibration_and_the_card_quotes_it(name):
    folder = resolve_head(name)
    with open(os.path.join(folder, "calibration.json")) as f:
        calibration = json.load(f)
    with open(os.path.join(folder, "oda_config.json")) as f:
        routing = json.load(f)
    assert calibration["split"] == "dev" and routing["policy"] == "head"
    assert routing["threshold"] == calibration["chosen"]["threshold"]
    assert calibration["chosen"] in calibration["sweep"]
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert f"theta = {routing['threshold']:g}" in card and "Held-out RULER test split" in card
    assert f"| **macro** | {SHIPPED[name][4]} |" in card
    if calibration["rule"] == "within_full":  # the card says whether the rule was met or fell back
        met = calibration["chosen"]["macro_score"] >= calibration["full_macro_score"] - calibration["within_full"]
        assert ("whose dev macro score is within" in card) == met
        assert ("the rule fell back to the best-scoring one" in card) == (not met)


@shipped
def test_shipped_head_round_trips_bit_exact(tmp_path, name):
    head = RecallHead.from_pretrained(resolve_head(name))
    head.save_pretrained(tmp_path)
    again = RecallHead.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def shaped_base(name: str):
    """A random one- or two-layer model with the base's shapes (Gemma: one sliding and one global layer)."""
    import transformers

    torch.manual_seed(0)
    if name == "smollm2":
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                                          head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                                          rope_theta=1e5)
        return transformers.LlamaForCausalLM(config).eval()
    if name == "qwen2.5-coder-0.5b":
        config = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=2,
                                          max_position_embeddings=32768, tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(config).eval()
    config = transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                           head_dim=256, sliding_window=512, max_position_embeddings=32768,
                                           layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(config).eval()


@shipped
def test_short_names_attach_the_shipped_head_with_its_threshold(name, caplog):
    """The head attaches by its short name to a base of its shapes and routes past s + w with its threshold."""
    _, vocab, sinks, window, _ = SHIPPED[name]
    model = OdaForCausalLM.from_pretrained(shaped_base(name), head=name)
    assert "weights" in caplog.text.lower()  # a base with other weights than the head's is named in a warning
    with open(os.path.join(resolve_head(name), "oda_config.json")) as f:
        assert model.oda_config.threshold == json.load(f)["threshold"]
    assert (model.oda_config.sinks, model.oda_config.window) == (sinks, window)
    length = sinks + window + 14
    ids = torch.randint(0, vocab, (1, length))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, length + 4)
    assert model.routing.scores.shape[1] == 3 and torch.isfinite(model.routing.scores).all()
