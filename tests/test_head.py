"""RecallHead: exact architecture, FP32, bit-exact save/load, model card, base compatibility, NaN fallback."""

import hashlib
import json
import os
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from oda_hf import HeadPolicy, OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from tiny_models import tiny_model


def test_parameter_count_matches_paper():
    head = RecallHead(RecallHeadConfig(hidden_size=2048))
    assert head.config.head_width == 1024
    assert sum(p.numel() for p in head.parameters()) == 28_325_889


@pytest.mark.parametrize("variant,depends,ignores", [
    ("H", "H", "EL"), ("E", "E", "HL"), ("L", "L", "HE"), ("HE", "HE", "L"),
    ("HL", "HL", "E"), ("EL", "EL", "H"), ("HEL", "HEL", ""),
])
def test_input_variants_read_exactly_their_streams(variant, depends, ignores):
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig(hidden_size=16, head_width=8, input_variant=variant))
    streams = {name: torch.randn(3, 16) for name in "HEL"}
    q = head(streams["H"], streams["E"], streams["L"])
    assert q.shape == (3,) and q.dtype == torch.float32
    for name in "HEL":
        changed = dict(streams, **{name: torch.randn(3, 16)})
        q2 = head(changed["H"], changed["E"], changed["L"])
        assert torch.equal(q, q2) == (name in ignores), name


def test_variant_fills_missing_streams_by_first_available():
    torch.manual_seed(0)
    he = RecallHead(RecallHeadConfig(hidden_size=16, head_width=8, input_variant="HE"))
    hel = RecallHead(RecallHeadConfig(hidden_size=16, head_width=8, input_variant="HEL"))
    hel.load_state_dict(he.state_dict())
    h, e = torch.randn(2, 16), torch.randn(2, 16)
    assert torch.equal(he(h, e, None), hel(h, e, h))  # HE -> (H, E, H)


def test_head_is_fp32_on_a_bf16_base():
    base = tiny_model("qwen3").to(torch.bfloat16)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=2, window=4))
    assert all(p.dtype == torch.float32 for p in model.recall_head.parameters())
    out = model.generate(input_ids=torch.randint(3, 97, (1, 10)), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 16) and model.routing.scores.dtype == torch.float32



def test_a_head_cast_by_the_user_runs_in_its_dtype():
    """`head.bfloat16()` (the model keeps its head FP32 through `to()`, but a user may cast the head itself) scores
    in bfloat16 from inputs of any dtype; it once failed with a bare matmul dtype error."""
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig(hidden_size=16, head_width=8))
    streams = [torch.randn(3, 16) for _ in range(3)]
    reference = head(*streams)
    head.bfloat16()
    for dtype in (torch.float32, torch.bfloat16):
        q = head(*(x.to(dtype) for x in streams))
        assert q.dtype == torch.bfloat16 and torch.allclose(q.float(), reference, atol=0.1, rtol=0.05)
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4))
    model.recall_head.bfloat16()
    model.generate(input_ids=torch.randint(3, 97, (1, 10)), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert model.routing.decided_steps_per_row.tolist() == [5] and model.routing.scores[0, -1].isfinite()


def test_save_load_round_trip_is_bit_exact(tmp_path):
    base = tiny_model("qwen3")
    config = RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4, oda_lambda=0.0, tau_hist=0.001,
                                       base_model_revision="abc123")
    head = RecallHead(config)
    head.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "oda_recall_head"
    assert (saved["hidden_size"], saved["base_vocab_size"], saved["sinks"], saved["window"]) == (32, 97, 2, 4)
    loaded = RecallHead.from_pretrained(tmp_path)
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "model.safetensors").values())
    card = (tmp_path / "README.md").read_text()
    assert "oda_recall_head" not in card and "abc123" in card and f"{sum(p.numel() for p in head.parameters()):,}" in card


def test_a_head_loaded_with_a_bf16_dtype_stays_fp32_and_bit_exact(tmp_path, caplog):
    """Found by a mutation audit: nothing failed when RecallHead.__init__ stopped forcing FP32, and a head loaded with
    the base's `dtype=torch.bfloat16` then came back rounded to bfloat16. The dtype not applied is said."""
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig(hidden_size=32, head_width=8))
    head.save_pretrained(tmp_path)
    for keyword in ("dtype", "torch_dtype"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            loaded = RecallHead.from_pretrained(tmp_path, **{keyword: torch.bfloat16})
        assert "RecallHead loads in FP32 whatever dtype is asked (torch.bfloat16)" in caplog.text, keyword
        assert all(p.dtype == torch.float32 for p in loaded.parameters()), keyword
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items()), keyword
    caplog.clear()
    with caplog.at_level("WARNING"):
        RecallHead.from_pretrained(tmp_path, dtype=torch.float32)
    assert "loads in FP32" not in caplog.text


def test_wrapper_saves_head_and_routing_only_and_loads_back(tmp_path):
    base = tiny_model("qwen3")
    base_dir, head_dir = tmp_path / "base", tmp_path / "head"
    base.save_pretrained(base_dir)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=2, window=4, threshold=0.25))
    model.save_pretrained(head_dir)
    assert not any("q_proj" in key for key in load_file(head_dir / "model.safetensors"))  # no base weights
    again = OdaForCausalLM.from_pretrained(str(base_dir), head=str(head_dir))
    assert (again.oda_config.sinks, again.oda_config.window, again.oda_config.threshold) == (2, 4, 0.25)
    ids = torch.randint(3, 97, (2, 9))
    a = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    decisions = model.routing.decisions
    b = again.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b) and torch.equal(decisions, again.routing.decisions)


def test_head_for_another_base_fails_naming_both():
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig(hidden_size=64, head_width=8, base_vocab_size=500,
                                       base_model_name_or_path="someone/other-model"))
    with pytest.raises(ValueError, match=r"someone/other-model.*hidden size: head 64, base 32.*vocab size: head 500, base 97"):
        OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4))


def test_a_gemma3_base_under_another_sliding_window_fails_the_fingerprint():
    """Found by a mutation audit: nothing failed when sliding_window and layer_types left the config fingerprint; the
    same weights under another sliding window (other hidden states) took the head without a word."""
    base = tiny_model("gemma3", seed=0)
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    assert head.check_base_fingerprint(tiny_model("gemma3", seed=0))
    assert not head.check_base_fingerprint(tiny_model("gemma3", seed=0, sliding_window=3))
    assert not head.check_base_fingerprint(tiny_model("gemma3", seed=0, layer_types=["sliding_attention"] * 4))


def test_a_head_recording_only_its_base_config_checks_it():
    """Found by a mutation audit: nothing failed when a head without a weight fingerprint (`for_base(config)`) skipped
    the config check too, so the same base under another RoPE theta took it silently."""
    base = tiny_model("qwen3", seed=0)
    head = RecallHead(RecallHeadConfig.for_base(base.config, head_width=8))
    assert head.config.base_fingerprint is None and head.config.base_config_sha256 is not None
    assert head.check_base_fingerprint(base)
    rope = {**base.config.rope_parameters, "rope_theta": 1234.0}
    assert not head.check_base_fingerprint(tiny_model("qwen3", seed=0, rope_parameters=rope))


def test_non_finite_scores_route_to_full():
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    with torch.no_grad():
        head.score.bias.fill_(float("nan"))
    model = OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=0.0))
    ids = torch.randint(3, 97, (2, 12))
    out = model.generate(input_ids=ids, max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert model.routing.decisions.shape == (2, 8) and model.routing.decisions.all()
    assert torch.isnan(model.routing.scores).all()
    assert torch.equal(out, base.generate(input_ids=ids, max_new_tokens=9, do_sample=False, pad_token_id=0))


def test_threshold_controls_the_rate():
    base = tiny_model("qwen3")
    torch.manual_seed(0)
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=2, window=4))
    ids = torch.randint(3, 97, (2, 12))
    rates = []
    for threshold in (-1e9, 1e9):
        model.set_routing(threshold=threshold)
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        rates.append(model.routing.full_call_rate)
    assert rates == [1.0, 0.0]
    # A HeadPolicy object without a threshold of its own reads the routing threshold, on both paths (it kept its
    # default 0 over it, a head's calibrated threshold included: rate 0.64 here at either threshold, exit 0)
    for threshold, rate in ((-1e9, 1.0), (1e9, 0.0)):
        model.set_routing(policy=HeadPolicy(), threshold=threshold)
        for fast in (False, True):
            model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, oda_fast=fast)
            assert model.routing.full_call_rate == rate
    model.set_routing(policy=HeadPolicy(1e9), threshold=-1e9)   # its own threshold wins, as a budget's does
    model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model.routing.full_call_rate == 0.0


def test_the_fast_path_refuses_a_head_policy_with_its_own_decide():
    """A HeadPolicy subclass with its own decide() inherits HeadPolicy's device rule: the static engine ran that one
    instead, with other tokens and decisions than the HF path's, exit 0."""
    from oda_hf.engine.support import FastPathUnsupported

    class Inverted(HeadPolicy):
        def decide(self, scores, step, batch_size, device):
            return ~super().decide(scores, step, batch_size, device)

    base = tiny_model("qwen3")
    model = OdaForCausalLM(base, RecallHead(RecallHeadConfig.for_base(base, head_width=8)),
                           OdaConfig(sinks=2, window=4, policy=Inverted()))
    ids = torch.randint(3, 97, (2, 12))
    model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with pytest.raises(FastPathUnsupported, match="overrides decide\\(\\) but inherits HeadPolicy's"):
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, oda_fast=True)


class FakeHubApi:
    """Stands in for huggingface_hub.HfApi: records the repos made and what push_to_hub uploads (`uploaded`: the last
    commit's files) and deletes; `files`: what one repo holds after the commits (files of an older save included)."""

    def __init__(self, files: dict | None = None):
        self.repos, self.uploaded, self.deleted, self.files = [], {}, [], dict(files or {})

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return type("Repo", (), {"repo_id": repo_id})()

    def list_repo_tree(self, repo_id, revision=None, token=None):
        from huggingface_hub.hf_api import RepoFile

        return [RepoFile(path=name, size=len(data), oid="0",
                         lfs={"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 0}
                         if name.endswith(".safetensors") else None)
                for name, data in self.files.items()]

    def hf_hub_download(self, repo_id, filename, revision=None, token=None):
        path = os.path.join(tempfile.mkdtemp(), filename)
        with open(path, "wb") as f:
            f.write(self.files[filename])
        return path

    def create_commit(self, repo_id, operations, **kwargs):
        from huggingface_hub import CommitOperationDelete

        self.uploaded = {}
        for op in operations:
            if isinstance(op, CommitOperationDelete):
                self.deleted.append(op.path_in_repo)
                self.files.pop(op.path_in_repo)
                continue
            with open(op.path_or_fileobj, "rb") as f:
                self.uploaded[op.path_in_repo] = self.files[op.path_in_repo] = f.read()
        return type("Commit", (), {"commit_url": f"https://hub.invalid/{repo_id}"})()


@pytest.mark.parametrize("which", ["head", "wrapper"])
def test_push_to_hub_uploads_head_files_only(monkeypatch, which):
    import transformers.utils.hub as hub

    fake = FakeHubApi()
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8))
    target = head if which == "head" else OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4))
    target.push_to_hub("someone/tiny-oda-head")
    expected = {"config.json", "model.safetensors", "README.md"} | ({"oda_config.json"} if which == "wrapper" else set())
    assert expected <= set(fake.uploaded)
    assert json.loads(fake.uploaded["config.json"])["model_type"] == "oda_recall_head"
    assert b"# ODA recall head for" in fake.uploaded["README.md"]  # our generated card, not a generic one


def test_missing_head_offline_names_the_problem(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time, so patch it
    with pytest.raises(OSError, match=r"(?s)Could not load the recall head 'nobody/no-such-head'.*HF_HUB_OFFLINE"):
        OdaForCausalLM.from_pretrained(tiny_model("qwen3"), head="nobody/no-such-head")
    with pytest.raises(FileNotFoundError, match="recall head folder .*missing-folder' does not exist"):
        OdaForCausalLM.from_pretrained(tiny_model("qwen3"), head=str(tmp_path / "missing-folder"))


def test_routing_defaults_to_the_geometry_the_head_was_trained_with(tmp_path):
    base = tiny_model("qwen3")
    head = RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=3, window=16))
    head.save_pretrained(tmp_path)
    model = OdaForCausalLM.from_pretrained(base, head=str(tmp_path))
    assert (model.oda_config.sinks, model.oda_config.window) == (3, 16)
    assert OdaForCausalLM(base, head).oda_config.window == 16
    assert OdaForCausalLM.from_pretrained(base, head=head, window=32).oda_config.window == 32  # explicit wins
