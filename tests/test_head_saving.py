"""Saving a recall head folder: where its routing defaults are read from, what a new save replaces (stale shards, a
calibration of other weights), one staged publish for every file, and save_pretrained(push_to_hub=True)."""

import json
import os

import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from oda_hf.config import CALIBRATION_NAME, ODA_CONFIG_NAME
from oda_hf.evaluation.calibration import save_calibration
from test_head import FakeHubApi
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


def new_head(base, seed):
    torch.manual_seed(seed)
    return RecallHead(RecallHeadConfig.for_base(base, head_width=8, sinks=2, window=4))


def routing(folder):
    return json.loads((folder / ODA_CONFIG_NAME).read_text())


def calibrate(folder, threshold=0.425):
    saved = OdaConfig.from_json_file(str(folder / ODA_CONFIG_NAME))
    save_calibration(folder, saved, {"chosen": {"threshold": threshold}})  # as `oda calibrate` does


# -- 1. oda_config.json is read from the folder the head is loaded from ------------------------------------------------
def test_routing_defaults_load_from_a_tilde_path_and_a_subfolder(base, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    head = new_head(base, 0)
    OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=0.7)).save_pretrained(tmp_path / "myhead")
    OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=0.7)).save_pretrained(tmp_path / "repo" / "sub")
    tilde = OdaForCausalLM.from_pretrained(base, head="~/myhead")
    sub = OdaForCausalLM.from_pretrained(base, head=str(tmp_path / "repo"), head_kwargs={"subfolder": "sub"})
    for model in (tilde, sub):
        assert (model.oda_config.sinks, model.oda_config.window, model.oda_config.threshold) == (2, 4, 0.7)


# -- 2. new weights over a calibrated head drop its calibration --------------------------------------------------------
def test_head_save_of_new_weights_drops_the_calibration(base, tmp_path, caplog):
    folder = tmp_path / "head"
    OdaForCausalLM(base, new_head(base, 0), OdaConfig(sinks=2, window=4)).save_pretrained(folder)
    calibrate(folder)
    with caplog.at_level("WARNING"):
        new_head(base, 1).save_pretrained(folder)
    assert not (folder / CALIBRATION_NAME).exists()
    assert routing(folder) == {"sinks": 2, "window": 4, "threshold": 0.0, "policy": "head"}  # only the threshold reset
    assert "saved uncalibrated" in caplog.text and CALIBRATION_NAME in caplog.text


def test_wrapper_save_of_new_weights_drops_the_calibration(base, tmp_path, caplog):
    folder = tmp_path / "head"
    OdaForCausalLM(base, new_head(base, 0), OdaConfig(sinks=2, window=4)).save_pretrained(folder)
    calibrate(folder)
    loaded = OdaForCausalLM.from_pretrained(base, head=str(folder))
    assert loaded.oda_config.threshold == 0.425
    loaded.set_head(new_head(base, 1))  # retrained: the threshold it carries was calibrated for the old weights
    with caplog.at_level("WARNING"):
        loaded.save_pretrained(folder)
    assert not (folder / CALIBRATION_NAME).exists() and routing(folder)["threshold"] == 0.0
    assert "saved uncalibrated" in caplog.text
    # A threshold the model was given is the caller's, kept (only the calibration file goes).
    calibrate(folder)
    OdaForCausalLM(base, new_head(base, 2), OdaConfig(sinks=2, window=4, threshold=0.3)).save_pretrained(folder)
    assert not (folder / CALIBRATION_NAME).exists() and routing(folder)["threshold"] == 0.3


@pytest.mark.parametrize("which", ["head", "wrapper"])
def test_saving_the_same_weights_again_keeps_the_calibration(base, tmp_path, caplog, which):
    folder = tmp_path / "head"
    head = new_head(base, 0)
    OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4)).save_pretrained(folder)
    calibrate(folder)
    with caplog.at_level("WARNING"):
        if which == "head":
            RecallHead.from_pretrained(folder).save_pretrained(folder)
        else:
            OdaForCausalLM.from_pretrained(base, head=str(folder)).save_pretrained(folder)
    assert (folder / CALIBRATION_NAME).exists() and routing(folder)["threshold"] == 0.425
    assert "uncalibrated" not in caplog.text


# -- 3. oda_config.json is published with the head, not before it ------------------------------------------------------
def test_wrapper_save_killed_while_writing_the_head_changes_nothing(base, tmp_path):
    folder = tmp_path / "head"
    old = new_head(base, 0)
    OdaForCausalLM(base, old, OdaConfig(sinks=2, window=4, threshold=0.1)).save_pretrained(folder)
    before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    new = new_head(base, 1)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing model.safetensors")

    new.save_files = killed
    with pytest.raises(KeyboardInterrupt):
        OdaForCausalLM(base, new, OdaConfig(sinks=8, window=16, threshold=0.9)).save_pretrained(folder)
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before


# -- 4. one model.safetensors, and no weight file of an older save stays -----------------------------------------------
def test_head_is_saved_unsharded_and_stale_weight_files_are_removed(base, tmp_path):
    folder = tmp_path / "head"
    new_head(base, 0).save_pretrained(folder)
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (folder / stale).write_bytes(b"an older save's")
    (folder / "notes.txt").write_text("the user's own")
    new = new_head(base, 1)
    new.save_pretrained(folder, max_shard_size=500)  # would shard into a dozen files: ignored
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    assert torch.equal(RecallHead.from_pretrained(folder).score.weight, new.score.weight)
    fresh = tmp_path / "fresh"
    new.save_pretrained(fresh, max_shard_size=500)
    assert torch.equal(RecallHead.from_pretrained(fresh).score.weight, new.score.weight)
    with pytest.raises(ValueError, match="model.safetensors only"):
        new.save_pretrained(tmp_path / "variant", variant="fp32")


# -- 5. save_pretrained(push_to_hub=True) pushes the published folder --------------------------------------------------
@pytest.mark.parametrize("which", ["head", "wrapper"])
def test_save_pretrained_with_push_to_hub_uploads_the_saved_folder(base, tmp_path, monkeypatch, which):
    import transformers.utils.hub as hub

    fake = FakeHubApi()
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    head = new_head(base, 0)
    target = head if which == "head" else OdaForCausalLM(base, head, OdaConfig(sinks=2, window=4, threshold=0.2))
    folder = tmp_path / "myhead"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own")
    target.save_pretrained(folder, push_to_hub=True)
    assert fake.repos == ["myhead"]  # the folder's name, not its staging folder's
    expected = {"config.json", "model.safetensors", "README.md"} | ({ODA_CONFIG_NAME} if which == "wrapper" else set())
    assert set(fake.uploaded) == expected
    assert b"# ODA recall head for" in fake.uploaded["README.md"]  # ODA's card, not transformers' generic one
    assert all(fake.uploaded[name] == (folder / name).read_bytes() for name in expected)
    target.save_pretrained(folder, push_to_hub=True, repo_id="me/other", commit_message="retrained")
    assert fake.repos[-1] == "me/other"


def calibrated_repo(base, tmp_path, seed=0) -> dict:
    """The files of a hub repo holding a calibrated head of `new_head(base, seed)` and a stale shard of a sharded
    save."""
    folder = tmp_path / f"calibrated-{seed}"
    OdaForCausalLM(base, new_head(base, seed), OdaConfig(sinks=2, window=4)).save_pretrained(folder)
    calibrate(folder)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    files["model-00001-of-00002.safetensors"] = b"an older sharded save"
    return files


def test_push_to_hub_clears_an_older_calibration_of_other_weights(base, tmp_path, monkeypatch, caplog):
    """Over a repo holding a calibrated head of other weights, a push deletes calibration.json and the stale weight
    files, and resets the threshold of the repo's oda_config.json (a load by id would otherwise route the new weights
    with the old ones' threshold); the same weights pushed again keep their calibration."""
    import transformers.utils.hub as hub

    fake = FakeHubApi(calibrated_repo(base, tmp_path))
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    with caplog.at_level("WARNING"):
        new_head(base, 1).push_to_hub("me/head")
    assert sorted(fake.deleted) == [CALIBRATION_NAME, "model-00001-of-00002.safetensors"]
    assert json.loads(fake.files[ODA_CONFIG_NAME]) == {"sinks": 2, "window": 4, "threshold": 0.0, "policy": "head"}
    assert "held a calibration of other weights" in caplog.text

    fake = FakeHubApi(calibrated_repo(base, tmp_path))  # the calibrated weights themselves, pushed again
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    new_head(base, 0).push_to_hub("me/head")
    assert fake.deleted == ["model-00001-of-00002.safetensors"] and CALIBRATION_NAME in fake.files
    assert json.loads(fake.files[ODA_CONFIG_NAME])["threshold"] == 0.425

    fake = FakeHubApi({**calibrated_repo(base, tmp_path), ODA_CONFIG_NAME: b"{not json"})
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    new_head(base, 1).push_to_hub("me/head")   # an unreadable oda_config.json goes rather than keep a threshold
    assert ODA_CONFIG_NAME in fake.deleted and ODA_CONFIG_NAME not in fake.files

    fake = FakeHubApi(calibrated_repo(base, tmp_path))  # a wrapper uploads its own routing: the caller's threshold
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    OdaForCausalLM(base, new_head(base, 1), OdaConfig(sinks=2, window=4, threshold=0.3)).save_pretrained(
        tmp_path / "mine", push_to_hub=True, repo_id="me/head")
    assert CALIBRATION_NAME not in fake.files and json.loads(fake.files[ODA_CONFIG_NAME])["threshold"] == 0.3
    # ... but a model loaded from the repo (the calibrated threshold 0.425) and given new weights does not upload that
    # threshold again with them (a review found the push kept it, where a local save resets it)
    fake = FakeHubApi(calibrated_repo(base, tmp_path))
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    OdaForCausalLM(base, new_head(base, 1), OdaConfig(sinks=2, window=4, threshold=0.425)).push_to_hub("me/head")
    assert CALIBRATION_NAME not in fake.files and json.loads(fake.files[ODA_CONFIG_NAME])["threshold"] == 0.0


# -- 6. head=<RecallHead object> warns about the folder's threshold it does not apply ----------------------------------
def test_head_object_from_a_folder_with_a_threshold_warns(base, tmp_path, caplog):
    folder = tmp_path / "head"
    OdaForCausalLM(base, new_head(base, 0), OdaConfig(sinks=2, window=4, threshold=0.5)).save_pretrained(folder)
    head = RecallHead.from_pretrained(folder)
    with caplog.at_level("WARNING"):
        model = OdaForCausalLM.from_pretrained(base, head=head)
    assert model.oda_config.threshold == 0.0  # routing unchanged: an object brings no routing defaults
    assert "threshold=0.5" in caplog.text and f"head={str(folder)!r}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        OdaForCausalLM.from_pretrained(base, head=head, threshold=0.2)  # chosen: nothing to say
        OdaForCausalLM.from_pretrained(base, head=str(folder))
    assert "brings no routing defaults" not in caplog.text


def test_shipping_the_organism_drops_an_earlier_shipments_calibration(tmp_path):
    """organism/ship.py copied only the files a new head has: an earlier head's calibration.json stayed in the
    assets, and the card quoted its threshold beside an oda_config.json of another."""
    from oda_hf.organism.ship import HEAD_FILES, _copy

    new, shipped = tmp_path / "new", tmp_path / "assets"
    new.mkdir(), shipped.mkdir()
    (new / "config.json").write_text("{}")
    (shipped / "calibration.json").write_text('{"chosen": {"threshold": 0.75}}')
    _copy(str(new), str(shipped), HEAD_FILES)
    assert sorted(os.listdir(shipped)) == ["config.json"]
