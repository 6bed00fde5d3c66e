"""Bad input at the API surface: every row is an input and the error it must raise (type + message fragment).

Each row's `call(tmp_path)` builds what it needs in a fresh folder, then performs the one bad call.
"""

from __future__ import annotations

import json
import math
import socket
import time

import pytest
import torch

from oda_hf import OdaConfig, OdaForCausalLM, RecallHead, RecallHeadConfig
from tiny_models import tiny_model

QWEN_HIDDEN = 32


def base():
    return tiny_model("qwen3")


def saved_head(folder, hidden_size=QWEN_HIDDEN, **config):
    torch.manual_seed(0)
    head = RecallHead(RecallHeadConfig(hidden_size=hidden_size, head_width=8, **config))
    head.save_pretrained(folder)
    return folder


def edit_json(path, **changes):
    values = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    path.write_text(json.dumps(values))


def head_without_weights(tmp):
    (saved_head(tmp / "head") / "model.safetensors").unlink()
    return tmp / "head"


def head_with_truncated_weights(tmp):
    weights = saved_head(tmp / "head") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    return tmp / "head"


def head_with_random_weights(tmp):
    weights = saved_head(tmp / "head") / "model.safetensors"
    weights.write_bytes(torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).numpy().tobytes())
    return tmp / "head"


def head_without_hidden_size(tmp):
    edit_json(saved_head(tmp / "head") / "config.json", hidden_size=None)
    return tmp / "head"


def head_with_broken_config(tmp):
    (saved_head(tmp / "head") / "config.json").write_text('{"model_type": "oda_recall_head",')
    return tmp / "head"


def head_with_wider_config_than_weights(tmp):
    edit_json(saved_head(tmp / "head") / "config.json", head_width=16)
    return tmp / "head"


def head_with_an_extra_weight(tmp):
    """A head of another version or layout: a weight this head does not have was dropped with transformers' load
    report only (found by an audit)."""
    import safetensors.torch

    path = saved_head(tmp / "head") / "model.safetensors"
    weights = safetensors.torch.load_file(path)
    weights["blocks.9.down_proj.weight"] = torch.zeros(2, 2)
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})
    return tmp / "head"


def head_without_a_weight(tmp):
    """A head whose model.safetensors lacks score.weight: found by a mutation audit, nothing failed when the check for
    missing tensors was dropped (the head then scored with a freshly initialised tensor)."""
    import safetensors.torch

    path = saved_head(tmp / "head") / "model.safetensors"
    weights = safetensors.torch.load_file(path)
    del weights["score.weight"]
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})
    return tmp / "head"


def head_with_negative_sinks(tmp):
    """A hand-edited config.json with sinks=-3: found by a mutation audit, nothing failed when the head config
    accepted negative sinks."""
    edit_json(saved_head(tmp / "head") / "config.json", sinks=-3)
    return tmp / "head"


def head_with_oda_config(tmp, text):
    (saved_head(tmp / "head") / "oda_config.json").write_text(text)
    return tmp / "head"


def base_model_folder(tmp):
    base().save_pretrained(tmp / "base")
    return tmp / "base"


def load_head(folder_builder):
    return lambda tmp: OdaForCausalLM.from_pretrained(base(), head=str(folder_builder(tmp)))


def unreachable_hub(tmp, monkeypatch):
    import huggingface_hub.constants

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for variable in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp / "empty-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp / "empty-cache"))
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)


ROWS = [
    # --- routing settings (OdaConfig, from_pretrained keywords, set_routing)
    ("window absurdly large", lambda tmp: OdaConfig(window=10**9), ValueError, "`window` must be an integer >= 1 and <= 16777216"),
    ("sinks absurdly large", lambda tmp: OdaConfig(sinks=2**30), ValueError, "`sinks` must be an integer >= 0 and <= 16777216"),
    ("negative sinks", lambda tmp: OdaConfig(sinks=-1), ValueError, "`sinks` must be an integer"),
    ("float window", lambda tmp: OdaConfig(window=1e7), ValueError, "`window` must be an integer >= 1"),
    ("bool window", lambda tmp: OdaConfig(window=True), ValueError, "`window` must be an integer"),
    ("NaN threshold", lambda tmp: OdaConfig(threshold=math.nan), ValueError, "`threshold` must be a finite number"),
    ("string threshold", lambda tmp: OdaConfig(threshold="0.5"), ValueError, "`threshold` must be a finite number"),
    ("unhashable policy", lambda tmp: OdaConfig(policy=["head"]), ValueError, "`policy` must be 'head', 'full'"),
    ("unknown policy name", lambda tmp: OdaConfig(policy="sometimes"), ValueError, "Unknown routing policy"),
    ("unknown routing key", lambda tmp: OdaConfig.from_kwargs(windw=4), TypeError, "Unknown OdaConfig keys ['windw']"),
    ("absurd window as a from_pretrained keyword",
     lambda tmp: OdaForCausalLM.from_pretrained(str(tmp / "never-read"), policy="full", window=10**9),
     ValueError, "`window` must be an integer >= 1 and <= 16777216"),
    ("absurd window via set_routing",
     lambda tmp: OdaForCausalLM(base(), oda_config=OdaConfig(policy="full")).set_routing(window=10**9),
     ValueError, "`window` must be an integer >= 1 and <= 16777216"),
    ("head policy without a head", lambda tmp: OdaForCausalLM(base()), ValueError, "policy='head' needs a recall head"),
    # --- where the base and the head come from
    ("missing base folder", lambda tmp: OdaForCausalLM.from_pretrained(str(tmp / "no-base"), policy="full"),
     FileNotFoundError, "base model folder"),
    ("missing relative head folder", lambda tmp: OdaForCausalLM.from_pretrained(base(), head="./no/such/head"),
     FileNotFoundError, "The recall head folder './no/such/head' does not exist"),
    ("missing head folder", lambda tmp: OdaForCausalLM.from_pretrained(base(), head=str(tmp / "no-head")),
     FileNotFoundError, "no-head' does not exist"),
    ("a file given as head", lambda tmp: OdaForCausalLM.from_pretrained(
        base(), head=str(saved_head(tmp / "head") / "model.safetensors")), NotADirectoryError, "is a file"),
    ("head object of the wrong type", lambda tmp: OdaForCausalLM(base(), recall_head=torch.nn.Linear(2, 1)),
     TypeError, "head must be a RecallHead"),
    # --- what a head folder holds
    ("base model's folder as head", load_head(base_model_folder), ValueError,
     "is not a recall head: "),
    ("head folder without weights", load_head(head_without_weights), FileNotFoundError,
     "has no model.safetensors: the recall head's weights are missing"),
    ("truncated head weights", load_head(head_with_truncated_weights), OSError,
     "model.safetensors is not a valid safetensors file (2000 bytes"),
    ("random bytes as head weights", load_head(head_with_random_weights), OSError,
     "model.safetensors is not a valid safetensors file"),
    ("head config without hidden_size", load_head(head_without_hidden_size), ValueError,
     "config.json lacks ['hidden_size']"),
    ("head config not JSON", load_head(head_with_broken_config), ValueError, "config.json is not valid JSON"),
    ("head weights narrower than their config", load_head(head_with_wider_config_than_weights), ValueError,
     "inconsistent: blocks.0.down_proj.weight is [8, 16], config.json implies [16, 32]"),
    ("head weights with one more tensor", load_head(head_with_an_extra_weight), ValueError,
     "inconsistent: unexpected blocks.9.down_proj.weight"),
    ("head weights without one tensor", load_head(head_without_a_weight), ValueError,
     "inconsistent: missing score.weight"),
    ("head config with negative sinks", lambda tmp: RecallHead.from_pretrained(head_with_negative_sinks(tmp)),
     ValueError, "`sinks` must be an integer >= 0"),
    ("RecallHead.from_pretrained of a base folder",
     lambda tmp: RecallHead.from_pretrained(base_model_folder(tmp)), ValueError, "is not a recall head"),
    ("head for another hidden size",
     lambda tmp: OdaForCausalLM.from_pretrained(base(), head=str(saved_head(tmp / "head", hidden_size=64))),
     ValueError, "hidden size: head 64, base 32"),
    # --- oda_config.json next to a head
    ("oda_config.json not JSON", load_head(lambda tmp: head_with_oda_config(tmp, "{sinks: 4")), ValueError,
     "oda_config.json is not valid JSON"),
    ("oda_config.json with an unknown key", load_head(lambda tmp: head_with_oda_config(tmp, '{"windw": 4}')),
     ValueError, "oda_config.json has unknown keys ['windw']"),
    ("oda_config.json with an invalid value", load_head(lambda tmp: head_with_oda_config(tmp, '{"window": 0}')),
     ValueError, "oda_config.json: `window` must be an integer"),
    ("oda_config.json not an object", load_head(lambda tmp: head_with_oda_config(tmp, "[4, 64]")), ValueError,
     "must hold a JSON object of routing keys"),
    # --- loading from the head folder alone
    ("head folder alone without a recorded base",
     lambda tmp: OdaForCausalLM.from_pretrained(str(saved_head(tmp / "head"))), ValueError,
     "does not record its base model"),
    ("head folder as base and head= as well",
     lambda tmp: OdaForCausalLM.from_pretrained(str(saved_head(tmp / "head", base_model_name_or_path="x")),
                                                head=str(tmp / "head")), ValueError, "and head= was given too"),
]


@pytest.mark.parametrize("call,error,fragment", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_raises_a_clear_error(call, error, fragment, tmp_path):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert fragment in str(info.value)


def test_unreachable_hub_fails_at_once_naming_the_id(tmp_path, monkeypatch):
    unreachable_hub(tmp_path, monkeypatch)
    start = time.perf_counter()
    with pytest.raises(OSError, match=r"'my-heda' is not a local folder, not in the local Hugging Face cache, and "
                                      r"the hub \(huggingface.co\) cannot be reached"):
        OdaForCausalLM.from_pretrained(base(), head="my-heda")
    with pytest.raises(OSError, match="The base model 'smolm2' is not a local folder"):
        OdaForCausalLM.from_pretrained("smolm2", policy="full")
    assert time.perf_counter() - start < 10  # the hub client's retries take about a minute


def test_owner_slash_name_stays_a_hub_id_even_when_the_owner_folder_exists(tmp_path, monkeypatch):
    from oda_hf.loading import looks_like_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen").mkdir()
    assert not looks_like_path("Qwen/Qwen3-1.7B") and not looks_like_path("smollm2")
    assert looks_like_path("./Qwen/x") and looks_like_path("runs/org/head") and looks_like_path("~/head")
