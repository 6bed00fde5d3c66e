"""Loading and saving that never lie: base fingerprints, loading from a head folder alone, AutoConfig, saved routing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig, SchedulePolicy
from oda_hf.head import base_fingerprint, register_auto_classes
from tiny_models import tiny_model

MISMATCH = "whose weights differ from"


def test_fingerprint_is_deterministic_dtype_stable_and_tells_weights_apart(tmp_path):
    base = tiny_model("qwen3", seed=0)
    digest = base_fingerprint(base)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert base_fingerprint(tiny_model("qwen3", seed=0)) == digest
    base.save_pretrained(tmp_path)
    reloaded = type(base).from_pretrained(tmp_path)
    assert base_fingerprint(reloaded) == digest
    # the same float32 checkpoint loaded in bfloat16: values are rounded as the fingerprint rounds them
    assert base_fingerprint(type(base).from_pretrained(tmp_path, dtype=torch.bfloat16)) == digest
    assert base_fingerprint(tiny_model("qwen3", seed=1)) != digest  # same shapes, other weights
    with torch.no_grad():
        reloaded.model.norm.weight[0] += 1.0  # one changed value in a sampled tensor
    assert base_fingerprint(reloaded) != digest


def test_fingerprint_ignores_bfloat16_rounding_of_bfloat16_weights():
    base = tiny_model("qwen3").to(torch.bfloat16)
    assert base_fingerprint(base) == base_fingerprint(base.float())


def test_fingerprint_of_a_peft_model_is_its_base_models():
    """Found by a mutation audit: nothing failed when base_fingerprint stopped unwrapping a peft model, whose
    parameter names (and LoRA tensors) then gave another digest than the base the head was trained on."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model("qwen3", seed=0), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert base_fingerprint(lora) == base_fingerprint(lora.get_base_model())


def test_head_records_its_base_and_warns_once_on_other_weights(tmp_path, caplog):
    base = tiny_model("qwen3", seed=0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    assert head.config.base_fingerprint == base_fingerprint(base)
    head.save_pretrained(tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["base_fingerprint"] == base_fingerprint(base)

    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(tiny_model("qwen3", seed=0), head=str(tmp_path / "head"))
    assert MISMATCH not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(tiny_model("qwen3", seed=1), head=str(tmp_path / "head"))
    assert caplog.text.count(MISMATCH) == 1

    unrecorded = RecallHead(RecallHeadConfig(hidden_size=32, head_width=8))  # heads saved before fingerprints
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM(tiny_model("qwen3", seed=1), unrecorded)
    assert MISMATCH not in caplog.text


def test_from_pretrained_of_a_head_folder_loads_the_recorded_base(tmp_path):
    base = tiny_model("qwen3", seed=0)
    base.save_pretrained(tmp_path / "base")
    loaded_base = type(base).from_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig.for_base(loaded_base, head_width=8, sinks=2, window=4))
    assert head.config.base_model_name_or_path == str(tmp_path / "base")
    explicit = OdaForCausalLM(loaded_base, head, OdaConfig(sinks=2, window=4, threshold=0.25))
    explicit.save_pretrained(tmp_path / "head")

    model = OdaForCausalLM.from_pretrained(str(tmp_path / "head"))
    assert model.oda_config.threshold == 0.25 and (model.oda_config.sinks, model.oda_config.window) == (2, 4)
    assert base_fingerprint(model.base_model) == head.config.base_fingerprint
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    settings = dict(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**settings), explicit.generate(**settings))
    assert torch.equal(model.routing.decisions, explicit.routing.decisions)


def test_a_head_id_with_revision_or_subfolder_loads_that_head(tmp_path, monkeypatch):
    """`from_pretrained("me/head", revision="v2")`: the head's config was read at v2 (its recorded base found), but
    the head itself loaded from main (other weights and threshold, exit 0) and the revision went to the base. Found by
    a mutation audit: nothing failed when the head's config.json was read at main (A and B had the same config)."""
    import shutil

    import huggingface_hub.constants

    base = tiny_model("qwen3", seed=0)
    base.save_pretrained(tmp_path / "base")
    loaded_base = type(base).from_pretrained(tmp_path / "base")
    heads = {}
    for name, seed, threshold, tau_hist in (("A", 1, 0.1, 0.001), ("B", 2, 0.9, 0.002)):   # tau_hist: metadata only
        torch.manual_seed(seed)
        heads[name] = RecallHead(RecallHeadConfig.for_base(loaded_base, head_width=8, sinks=2, window=4,
                                                           tau_hist=tau_hist))
        OdaForCausalLM(loaded_base, heads[name], OdaConfig(sinks=2, window=4, threshold=threshold)).save_pretrained(
            tmp_path / name)
    repo = tmp_path / "hub" / "models--me--head"   # an offline hub cache: main holds A (and B under sub/), v2 B
    for commit, name in (("a" * 40, "A"), ("b" * 40, "B")):
        shutil.copytree(tmp_path / name, repo / "snapshots" / commit)
    shutil.copytree(tmp_path / "B", repo / "snapshots" / ("a" * 40) / "sub")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v2").write_text("b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for kwargs, expected, threshold in (({}, "A", 0.1), ({"revision": "v2"}, "B", 0.9),
                                        ({"subfolder": "sub"}, "B", 0.9)):
        model = OdaForCausalLM.from_pretrained("me/head", **kwargs)
        assert model.oda_config.threshold == threshold, kwargs
        assert all(torch.equal(model.recall_head.state_dict()[k], v) for k, v in heads[expected].state_dict().items())
        assert model.recall_head.config.tau_hist == heads[expected].config.tau_hist, kwargs   # and its config
        head = RecallHead.from_pretrained("me/head", **kwargs)
        assert head.config.tau_hist == heads[expected].config.tau_hist, kwargs


def test_a_local_head_folder_with_subfolder_loads_the_base_that_head_records(tmp_path):
    """Found by a mutation audit: nothing failed when the model type of a local folder was read from its root's
    config.json with subfolder= given, so head B (in sub/) could load under head A's recorded base."""
    fingerprints = []
    for seed in (0, 1):   # head A (for base0) at the repo's root, head B (for base1) in sub/
        saved = tiny_model("qwen3", seed=seed)
        saved.save_pretrained(tmp_path / f"base{seed}")
        base = type(saved).from_pretrained(tmp_path / f"base{seed}")   # records its folder as its name
        fingerprints.append(base_fingerprint(base))
        head = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
        OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4)).save_pretrained(
            tmp_path / "repo" / ("sub" if seed else ""))
    model = OdaForCausalLM.from_pretrained(str(tmp_path / "repo"), subfolder="sub")
    assert model.recall_head.config.base_fingerprint == fingerprints[1] != fingerprints[0]
    assert base_fingerprint(model.base_model) == fingerprints[1]


def test_an_uncached_routing_config_of_a_hub_head_is_named_offline(tmp_path, monkeypatch, caplog):
    """Found by an audit: `RecallHead.from_pretrained("me/head")` caches the weights and config only; offline, a
    later `from_pretrained(base, head="me/head")` then routed at threshold 0 instead of the saved one, silently."""
    import shutil

    import huggingface_hub.constants

    base = tiny_model("qwen3", seed=0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
    OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=0.3)).save_pretrained(tmp_path / "A")
    repo = tmp_path / "hub" / "models--me--head"
    shutil.copytree(tmp_path / "A", repo / "snapshots" / ("a" * 40))
    (repo / "snapshots" / ("a" * 40) / "oda_config.json").unlink()   # cached without it
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with caplog.at_level("WARNING"):
        model = OdaForCausalLM.from_pretrained(base, head="me/head")
    assert model.oda_config.threshold == 0.0 and "could not be read" in caplog.text
    (repo / ".no_exist" / ("a" * 40)).mkdir(parents=True)   # known to be absent from the repository: no warning
    (repo / ".no_exist" / ("a" * 40) / "oda_config.json").touch()
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(base, head="me/head")
    assert "could not be read" not in caplog.text


def test_a_threshold_set_for_another_head_or_geometry_is_named(tmp_path, caplog):
    """Found by an audit: set_head() kept the previous head's (calibrated) threshold and a save published it with the
    new weights; a threshold calibrated at another window, and set_routing(window=...) away from the trained one,
    were used without a word."""
    base = tiny_model("qwen3", seed=0)
    torch.manual_seed(1)
    first = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
    torch.manual_seed(2)
    second = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
    model = OdaForCausalLM(base, first, OdaConfig(sinks=2, window=4, threshold=0.4))
    with caplog.at_level("WARNING"):
        model.set_head(first)   # the same weights: nothing to say
    assert "previous recall head" not in caplog.text
    with caplog.at_level("WARNING"):
        model.set_head(second)
    assert "threshold 0.4 was set with the previous recall head" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        model.set_routing(window=8)
    assert "trained with window=4, but routing uses window=8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):   # found by a mutation audit: nothing failed without the sinks warning
        model.set_routing(sinks=3)
    assert "trained with sinks=2, but routing uses sinks=3" in caplog.text
    model.set_routing(sinks=2)
    # calibrated at window 8 (calibration.json beside the weights), loaded at the trained window 4
    model.save_pretrained(tmp_path / "h")
    (tmp_path / "h" / "calibration.json").write_text(json.dumps({"sinks": 2, "window": 8,
                                                                 "chosen": {"threshold": 0.4}}))
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(base, head=str(tmp_path / "h"), window=4)
    assert "threshold 0.4 was calibrated at window=8, but routing uses window=4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(base, head=str(tmp_path / "h"))
    assert "calibrated at" not in caplog.text


def test_a_head_on_the_same_weights_under_another_config_is_named(tmp_path, caplog):
    """Found by an audit: the head's identity of its base covered the weights only, so the same weights under another
    RoPE (or sliding window) took the head without a word, while every output changed."""
    base = tiny_model("qwen3", seed=0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))
    base.save_pretrained(tmp_path / "base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": 1234.0}
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    other = type(base).from_pretrained(tmp_path / "base")
    with caplog.at_level("WARNING"):
        OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4))
    assert "under another configuration" not in caplog.text
    with caplog.at_level("WARNING"):
        OdaForCausalLM(other, head, OdaConfig(sinks=2, window=4))
    assert "under another configuration" in caplog.text


def test_a_head_config_for_a_short_name():
    """README's recipe, `RecallHeadConfig.for_base("smollm2")`, asked the hub for a model named smollm2."""
    config = RecallHeadConfig.for_base("organism", head_width=8)
    assert config.base_model_name_or_path == "organism" and config.hidden_size > 0


def test_auto_classes_know_the_recall_head_and_registration_is_idempotent(tmp_path):
    RecallHead(RecallHeadConfig(hidden_size=32, head_width=8)).save_pretrained(tmp_path)
    register_auto_classes()  # `import oda_hf` did it once; again must not raise
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "oda_recall_head" and config.hidden_size == 32
    assert type(AutoModel.from_pretrained(tmp_path)).__name__ == "RecallHead"


def test_import_oda_hf_after_transformers_registers_the_head_config(tmp_path):
    RecallHead(RecallHeadConfig(hidden_size=32, head_width=8)).save_pretrained(tmp_path)
    code = ("import sys, transformers, oda_hf\n"
            "assert 'oda_hf.head' in sys.modules\n"
            f"print(transformers.AutoConfig.from_pretrained({str(tmp_path)!r}).model_type)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "oda_recall_head"


def test_saving_with_a_policy_object_keeps_the_savable_routing_and_says_what_is_not(tmp_path, caplog):
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=3, window=8, threshold=0.7, policy=SchedulePolicy(1, 4)))
    with caplog.at_level("WARNING"):
        model.save_pretrained(tmp_path)
    assert "not the policy SchedulePolicy" in caplog.text
    assert json.loads((tmp_path / "oda_config.json").read_text()) == {"sinks": 3, "window": 8, "threshold": 0.7}
    reloaded = OdaForCausalLM.from_pretrained(base, head=str(tmp_path))
    assert (reloaded.oda_config.sinks, reloaded.oda_config.window, reloaded.oda_config.threshold) == (3, 8, 0.7)
    assert reloaded.oda_config.policy == "head"


def test_shipped_organism_head_records_its_shipped_backbone(caplog):
    from oda_hf.organism.demo import load_organism

    with caplog.at_level("WARNING"):
        model, _, _ = load_organism()
    assert MISMATCH not in caplog.text
    assert model.recall_head.config.base_fingerprint == base_fingerprint(model.base_model)


def test_a_base_recorded_relative_to_a_head_folder_given_with_tilde(tmp_path, monkeypatch):
    """A head folder named with ``~`` finds a base recorded relative to it (not a same-named folder elsewhere)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    base = tiny_model("qwen3", seed=0)
    base.save_pretrained(tmp_path / "base")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8, base_model_name_or_path="../../base"))
    OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4)).save_pretrained(tmp_path / "heads" / "h")
    (tmp_path / "work" / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "a" / "b")  # no "../../base" from the working folder
    model = OdaForCausalLM.from_pretrained("~/heads/h")
    assert base_fingerprint(model.base_model) == base_fingerprint(base)
