"""The recall head (paper Appendix A.2): a small FP32 network that scores whether Full pays.

Inputs: ``H`` the preceding selected final hidden state, ``E`` the current token's input embedding
(as the model feeds it) and ``L`` the current Local final hidden state. Output: one score ``q``
per row; the learned policy calls Full when ``q > theta``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.utils import logging

from .config import CALIBRATION_NAME
from .validation import MAX_SPAN, integer, number

logger = logging.get_logger(__name__)

INPUT_VARIANTS = {
    # missing streams are filled by the first available of H, E, L (ODA_SPEC section 4)
    "H": ("H", "H", "H"),
    "E": ("E", "E", "E"),
    "L": ("L", "L", "L"),
    "HE": ("H", "E", "H"),
    "HL": ("H", "H", "L"),
    "EL": ("E", "E", "L"),
    "HEL": ("H", "E", "L"),
}


#: Largest accepted hidden size / head width: above any model's hidden size, far below where a typo (1e9)
#: would try to allocate the head.
MAX_WIDTH = 1 << 20


def _optional(check, name, value, **bounds):
    return None if value is None else check(name, value, **bounds)


class RecallHeadConfig(PretrainedConfig):
    """Configuration of a `RecallHead`.

    Args:
        hidden_size: the base model's hidden size ``d`` (width of H, E and L).
        head_width: tower width ``m`` (default ``hidden_size // 2``).
        input_variant: which streams the head reads: one of H, E, L, HE, HL, EL, HEL.
        rms_norm_eps: epsilon of the head's RMSNorms.
        base_model_name_or_path / base_model_revision: the base model the head was trained for
            (`OdaForCausalLM.from_pretrained(head_folder)` loads it).
        base_vocab_size: that base model's vocabulary size.
        base_fingerprint: `base_fingerprint(base)` of that model's weights; attaching the head to a
            base with another fingerprint logs a warning.
        base_config_sha256: `base_config_fingerprint(base)` of its config's forward settings (RoPE, windows...);
            attaching the head to the same weights under other ones logs a warning.
        sinks / window: the Local access set the head was trained with.
        oda_lambda / tau_hist: training penalty and history threshold (ODA_SPEC section 5).
    """

    model_type = "oda_recall_head"

    def __init__(
        self,
        hidden_size: int = 2048,
        head_width: int | None = None,
        input_variant: str = "HEL",
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        base_model_name_or_path: str | None = None,
        base_model_revision: str | None = None,
        base_vocab_size: int | None = None,
        base_fingerprint: str | None = None,
        base_config_sha256: str | None = None,
        sinks: int | None = None,
        window: int | None = None,
        oda_lambda: float | None = None,
        tau_hist: float | None = None,
        **kwargs,
    ):
        try:
            self._set_checked(hidden_size, head_width, input_variant, rms_norm_eps, initializer_range,
                              base_model_name_or_path, base_model_revision, base_vocab_size, base_fingerprint, sinks,
                              window, oda_lambda, tau_hist, base_config_sha256)
        except TypeError as err:  # as OdaConfig: a wrong type in config.json is a bad value to its readers
            raise ValueError(str(err)) from None
        super().__init__(**kwargs)

    def _set_checked(self, hidden_size, head_width, input_variant, rms_norm_eps, initializer_range,
                     base_model_name_or_path, base_model_revision, base_vocab_size, base_fingerprint, sinks, window,
                     oda_lambda, tau_hist, base_config_sha256) -> None:
        # Checked here, so that a hand-edited or corrupt head config.json fails in one line naming the field
        # instead of deep inside nn.Linear (a width of 0 or -3) or at the first forward (NaN eps).
        if not isinstance(input_variant, str) or input_variant not in INPUT_VARIANTS:
            raise ValueError(f"`input_variant` must be one of {sorted(INPUT_VARIANTS)}; got {input_variant!r}.")
        self.hidden_size = integer("hidden_size", hidden_size, minimum=1, maximum=MAX_WIDTH)
        if head_width is None:
            head_width = self.hidden_size // 2
            if head_width < 1:
                raise ValueError(f"`hidden_size` {hidden_size} is too small for the default head width hidden_size "
                                 "// 2; give head_width >= 1.")
        self.head_width = integer("head_width", head_width, minimum=1, maximum=MAX_WIDTH)
        self.input_variant = input_variant
        self.rms_norm_eps = number("rms_norm_eps", rms_norm_eps, minimum=0.0, exclusive_minimum=True)
        self.initializer_range = number("initializer_range", initializer_range, minimum=0.0)
        for name, value in (("base_model_name_or_path", base_model_name_or_path),
                            ("base_model_revision", base_model_revision), ("base_fingerprint", base_fingerprint),
                            ("base_config_sha256", base_config_sha256)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{name}` must be a string or None; got {value!r} ({type(value).__name__}).")
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_revision = base_model_revision
        self.base_vocab_size = _optional(integer, "base_vocab_size", base_vocab_size, minimum=1)
        self.base_fingerprint = base_fingerprint
        self.base_config_sha256 = base_config_sha256
        self.sinks = _optional(integer, "sinks", sinks, minimum=0, maximum=MAX_SPAN)
        self.window = _optional(integer, "window", window, minimum=1, maximum=MAX_SPAN)
        self.oda_lambda = _optional(number, "oda_lambda", oda_lambda, minimum=0.0)
        self.tau_hist = _optional(number, "tau_hist", tau_hist)

    @classmethod
    def for_base(cls, base, **kwargs) -> "RecallHeadConfig":
        """A config sized for `base` (a model, a config, or a hub id / local path / fetched short name of one).

        Given a loaded model, it also records `base_fingerprint(base)`; given a model or a config, its
        `base_config_fingerprint`.
        """
        if isinstance(base, str):
            from .known_models import resolve_base   # a fetched model's short name ("smollm2") too

            config = AutoConfig.from_pretrained(resolve_base(base))
        else:
            config = getattr(base, "config", base)
        if isinstance(base, nn.Module):
            kwargs.setdefault("base_fingerprint", base_fingerprint(base))
        kwargs.setdefault("base_config_sha256", base_config_fingerprint(config))
        text = config.get_text_config(decoder=True)
        name = getattr(config, "_name_or_path", None) or (base if isinstance(base, str) else None)
        from .known_models import short_name_of  # a fetched base is recorded by its short name, not this machine's path

        kwargs.setdefault("base_model_name_or_path", short_name_of(name) or name)
        return cls(hidden_size=text.hidden_size, base_vocab_size=text.vocab_size, **kwargs)

    def check_compatible(self, base_config) -> None:
        """Raise if a head of this config cannot read `base_config`'s hidden states or embeddings."""
        text = base_config.get_text_config(decoder=True)
        problems = []
        if text.hidden_size != self.hidden_size:
            problems.append(f"hidden size: head {self.hidden_size}, base {text.hidden_size}")
        if self.base_vocab_size is not None and text.vocab_size != self.base_vocab_size:
            problems.append(f"vocab size: head {self.base_vocab_size}, base {text.vocab_size}")
        if problems:
            trained_for = self.base_model_name_or_path or "an unrecorded base model"
            base_name = getattr(base_config, "_name_or_path", "") or "this base model"
            raise ValueError(
                f"This recall head was trained for {trained_for} and does not fit {base_name} "
                f"({'; '.join(problems)}). Load a head trained for this base model, or train one with "
                "OdaTrainer / `oda train-head`."
            )


FINGERPRINT_SAMPLES = 1024  # values read per parameter tensor


def base_fingerprint(model: nn.Module) -> str | None:
    """SHA-256 identifying a base model's weights, cheaply and deterministically.

    Hashes every parameter's name and shape and `FINGERPRINT_SAMPLES` evenly strided values of it,
    rounded to bfloat16 so that one checkpoint loaded in float32 or bfloat16 gives the same digest
    (a float16 load can differ). None when weights are not materialised (meta / offloaded).
    """
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                return None
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = flat[::step][:FINGERPRINT_SAMPLES].to(device="cpu", dtype=torch.bfloat16)
            digest.update(f"{name}:{tuple(param.shape)};".encode())
            digest.update(sample.view(torch.int16).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def head_fingerprint(head) -> str | None:
    """SHA-256 of a recall head's weights (names, dtypes, shapes and bytes, in name order); None without a head."""
    if head is None:
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{str(tensor.dtype).removeprefix('torch.')}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


#: Config fields that change what the base computes from the same weights (RoPE, windows, attention shape, norms,
#: soft-capping, linear-attention shape): hidden states, gains and outputs hold for these values only.
FORWARD_CONFIG_KEYS = (
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "sliding_window", "layer_types",
    "use_sliding_window", "max_window_layers", "attention_chunk_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "hidden_activation", "rms_norm_eps", "layer_norm_eps", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "full_attention_interval", "linear_conv_kernel_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "max_position_embeddings", "original_max_position_embeddings",   # (dynamic RoPE's original length)
)


def base_config_fingerprint(model_or_config) -> str:
    """SHA-256 of the `FORWARD_CONFIG_KEYS` of a base (a model, an `OdaForCausalLM`, or its config; its weights are
    `base_fingerprint`'s): the same weights under another RoPE scaling or sliding window compute other hidden states."""
    from .modeling import OdaForCausalLM

    model = model_or_config.base_model if isinstance(model_or_config, OdaForCausalLM) else model_or_config
    config = model.config if isinstance(model, nn.Module) else model
    values = config.get_text_config(decoder=True).to_dict()
    fields = {key: values[key] for key in FORWARD_CONFIG_KEYS if key in values}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


class RecallHeadRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RecallHeadTower(nn.Module):
    """RMSNorm(d) -> Linear(d, m, bias) -> SiLU."""

    def __init__(self, hidden_size: int, width: int, eps: float):
        super().__init__()
        self.norm = RecallHeadRMSNorm(hidden_size, eps)
        self.proj = nn.Linear(hidden_size, width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(self.proj(self.norm(x)))


class RecallHeadSwiGLUBlock(nn.Module):
    """Pre-RMSNorm residual SwiGLU block: gate/up Linear(m, 2m), down Linear(2m, m), no biases."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.norm = RecallHeadRMSNorm(width, eps)
        self.gate_proj = nn.Linear(width, 2 * width, bias=False)
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class RecallHead(PreTrainedModel):
    """The recall head: three towers, a pairwise-interaction fusion, two SwiGLU blocks, a scalar out.

    FP32 whatever the base model's dtype (`OdaForCausalLM` keeps it so through `to()`): `forward` casts its inputs
    to the head's own dtype, so a head a user casts itself (``head.bfloat16()``) runs in that dtype.
    """

    config_class = RecallHeadConfig
    base_model_prefix = "recall_head"
    main_input_name = "local_hidden"
    _no_split_modules = []

    def __init__(self, config: RecallHeadConfig):
        super().__init__(config)
        d, m, eps = config.hidden_size, config.head_width, config.rms_norm_eps
        self.tower_a = RecallHeadTower(d, m, eps)
        self.tower_b = RecallHeadTower(d, m, eps)
        self.tower_c = RecallHeadTower(d, m, eps)
        self.fusion = nn.Linear(9 * m, m, bias=True)
        self.blocks = nn.ModuleList([RecallHeadSwiGLUBlock(m, eps) for _ in range(2)])
        self.final_norm = RecallHeadRMSNorm(m, eps)
        self.score = nn.Linear(m, 1, bias=True)
        self.post_init()
        self.float()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RecallHeadRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        prev_hidden: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
        local_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Score ``q`` of shape ``[...]`` from H (`prev_hidden`), E (`input_embeds`), L (`local_hidden`)."""
        streams = {"H": prev_hidden, "E": input_embeds, "L": local_hidden}
        for name in set(self.config.input_variant):
            if streams[name] is None:
                raise ValueError(f"RecallHead variant {self.config.input_variant} needs stream {name}.")
        dtype = self.score.weight.dtype
        a, b, c = (
            tower(streams[name].to(dtype))
            for tower, name in zip(
                (self.tower_a, self.tower_b, self.tower_c), INPUT_VARIANTS[self.config.input_variant]
            )
        )
        u = torch.cat([a, b, c, a * b, (a - b).abs(), a * c, (a - c).abs(), b * c, (b - c).abs()], dim=-1)
        z = 0.5 * (a + b + c + nn.functional.silu(self.fusion(u)))
        for block in self.blocks:
            z = block(z)
        return self.score(self.final_norm(z)).squeeze(-1)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a saved head; a folder that is not a complete recall head is an error, never a random init.

        Checks before loading: the folder exists (or the hub id is cached or reachable), its config.json is
        an ``oda_recall_head`` config with ``hidden_size``, and model.safetensors is a valid safetensors file;
        after: every weight was loaded.
        """
        from .loading import HUB_KWARGS, resolve_head_folder

        folder = resolve_head_folder(pretrained_model_name_or_path, kwargs)
        kwargs = {key: value for key, value in kwargs.items() if key not in HUB_KWARGS}
        config = kwargs.pop("config", None) or RecallHeadConfig.from_pretrained(folder)
        asked = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if asked not in (None, "auto", "float32", torch.float32):   # (said, not silent: the head stays FP32)
            logger.warning(f"RecallHead loads in FP32 whatever dtype is asked ({asked}): its scores are compared with "
                           f"a threshold calibrated in FP32. To run it in {asked} anyway, cast it: head.to({asked}).")
        cls._check_saved_weights(folder, config)
        model = super().from_pretrained(folder, *args, config=config, **kwargs)
        # Where it came from: OdaForCausalLM reads that folder's routing defaults (oda_config.json) for head=<name>,
        # and warns when head=<this object> leaves a saved threshold unapplied.
        model._oda_source_folder = os.path.normpath(folder)
        return model

    @classmethod
    def _check_saved_weights(cls, folder: str, config: RecallHeadConfig) -> None:
        """Raise unless model.safetensors holds every weight of `config`'s head, in its shape."""
        from safetensors import safe_open
        from transformers.utils import SAFE_WEIGHTS_NAME

        with torch.device("meta"):
            expected = {name: tuple(t.shape) for name, t in cls(config).state_dict().items()}
        with safe_open(os.path.join(folder, SAFE_WEIGHTS_NAME), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        problems = [f"missing {name}" for name in sorted(set(expected) - set(stored))]
        problems += [f"{name} is {list(stored[name])}, config.json implies {list(shape)}"
                     for name, shape in sorted(expected.items()) if name in stored and stored[name] != shape]
        # weights this head does not have (a head of another version or layout): dropped, they would change nothing
        # of what it computes, while the folder's head did compute with them
        problems += [f"unexpected {name}" for name in sorted(set(stored) - set(expected))]
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise ValueError(
                f"The recall head in {folder} is incomplete or inconsistent: {shown}. Its {SAFE_WEIGHTS_NAME} does "
                "not match its config.json; save the head again."
            )

    # -- compatibility with a base model -----------------------------------------------------------
    def check_compatible(self, base_config) -> None:
        """Raise if this head cannot read the base model's hidden states or embeddings."""
        self.config.check_compatible(base_config)

    def check_base_fingerprint(self, base_model: nn.Module) -> bool:
        """Warn (and return False) if the head records a base fingerprint, or a config fingerprint, that
        `base_model` does not match."""
        recorded = self.config.base_fingerprint
        if recorded is None:
            return self._check_base_config(base_model)
        actual = base_fingerprint(base_model)
        if actual is None or actual == recorded:
            return self._check_base_config(base_model)
        trained_for = self.config.base_model_name_or_path or "another base model"
        base_name = getattr(base_model.config, "_name_or_path", "") or "this base model"
        logger.warning(
            f"This recall head was trained for {trained_for}, whose weights differ from {base_name}'s (base "
            f"fingerprint {recorded[:19]}... vs {actual[:19]}...). Its routing decisions are likely meaningless "
            "for this base; use a head trained for it (or the same weights loaded in float32/bfloat16)."
        )
        return False

    def _check_base_config(self, base_model: nn.Module) -> bool:
        recorded = getattr(self.config, "base_config_sha256", None)
        if recorded is None or recorded == base_config_fingerprint(base_model):
            return True
        logger.warning("This recall head was trained on these weights under another configuration (RoPE, windows, "
                       "norms or attention shape differ from the ones it recorded): its routing decisions may not "
                       "hold; load the base with the configuration the head was trained with, or train a head for "
                       "this one.")
        return False

    # -- saving and publishing --------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, model_card_fields: dict | None = None, push_to_hub: bool = False,
                        **kwargs):
        """config.json + model.safetensors, and README.md generated from `model_cards/recall_head.md`.

        Complete or not at all: the files are written into a staging folder beside `save_directory` and moved
        in with config.json last (removed first), so a run killed mid-save never leaves a head that loads
        half-written (e.g. a 0-byte config.json). Weight files of an older save (shards, an index) are removed,
        and so is a calibration (`oda calibrate`) of other weights: calibration.json, and its threshold in
        oda_config.json goes back to the default. The weights are always one model.safetensors (``max_shard_size``
        is ignored). ``push_to_hub=True`` (with ``repo_id``, default the folder's name, ``commit_message``,
        ``private``, ``token``...) then uploads the files this save wrote, ODA's model card included."""
        push = pop_push_kwargs(push_to_hub, kwargs)
        written = self._save_folder(save_directory, *args, model_card_fields=model_card_fields, **kwargs)
        if push is not None:
            push_published(save_directory, written, **push)

    def _save_folder(self, save_directory, *args, oda_config=None, model_card_fields: dict | None = None,
                     **kwargs) -> list[str]:
        """Stage the head's files (and `oda_config`'s oda_config.json, when given) and publish them together into
        `save_directory`; returns the names published."""
        from .config import ODA_CONFIG_NAME, OdaConfig
        from .files import publish_files, staging_folder

        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory} is a file: save the recall head to a folder (a new or existing one).")
        staging = staging_folder(save_directory)
        try:
            self.save_files(staging, *args, model_card_fields=model_card_fields, **kwargs)
            replaces = list(HEAD_WEIGHT_FILES)
            if _holds_calibration_of_other_weights(save_directory, staging):
                replaces.append(CALIBRATION_NAME)
                oda_config, unreadable = uncalibrated_routing(save_directory, oda_config)
                if unreadable:
                    replaces.append(ODA_CONFIG_NAME)  # can't be rewritten: gone rather than left with the old threshold
                threshold = (oda_config or OdaConfig()).threshold
                logger.warning(
                    f"{save_directory} held a calibrated head of other weights: the new weights are saved uncalibrated "
                    f"(threshold {threshold:g}, {CALIBRATION_NAME} removed); run `oda calibrate` on them again.")
            if oda_config is not None:
                oda_config.save_pretrained(staging)
            return publish_files(staging, save_directory, marker="config.json", replaces=replaces)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def save_files(self, directory, *args, model_card_fields: dict | None = None, **kwargs):
        """What `save_pretrained` publishes, written straight into `directory` (for callers that stage a folder
        of more files themselves, as OdaTrainer does)."""
        # One model.safetensors, always: loading reads that file only (a sharded head would not load, and shards
        # beside an older model.safetensors would leave that one loading). A head is small; max_shard_size is ignored.
        kwargs.pop("max_shard_size", None)
        if kwargs.get("variant") is not None:
            raise ValueError(f"variant={kwargs['variant']!r}: a recall head is saved as model.safetensors only "
                             "(loading reads no other name); save each variant to its own folder instead.")
        super().save_pretrained(directory, *args, max_shard_size=UNSHARDED, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            from .model_card import write_head_model_card

            write_head_model_card(self, directory, extra=model_card_fields)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload what `save_pretrained` writes (keeping ODA's generated model card)."""
        from .hub import push_saved_to_hub

        return push_saved_to_hub(self, repo_id, **kwargs)


#: Large enough that transformers never shards a head's weights.
UNSHARDED = 1 << 62
#: A saved head's weights under any name transformers writes: files matching them that a new save does not write
#: (shards and index of a sharded save, pytorch weights) are an older save's, removed when the new one is published.
HEAD_WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                     "pytorch_model.bin.index.json")
#: What `save_pretrained(push_to_hub=True)` takes for the upload (as transformers' save_pretrained does).
PUSH_KWARGS = ("repo_id", "commit_message", "commit_description", "private", "token", "create_pr", "revision")


def _same_weights(path_a: str, path_b: str) -> bool:
    """Whether two safetensors files hold the same tensors, bit for bit (False if either is missing or unreadable)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path_a, framework="pt") as a, safe_open(path_b, framework="pt") as b:
            if set(a.keys()) != set(b.keys()):
                return False
            for name in a.keys():
                x, y = a.get_tensor(name), b.get_tensor(name)
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                    return False
    except (OSError, SafetensorError, ValueError):
        return False
    return True


def _holds_calibration_of_other_weights(folder, staging: str) -> bool:
    """Whether `folder` holds a calibration (`oda calibrate`) measured on other weights than the staged ones. The
    same weights saved again keep theirs."""
    from transformers.utils import SAFE_WEIGHTS_NAME

    if not os.path.isfile(os.path.join(folder, CALIBRATION_NAME)):
        return False
    return not _same_weights(os.path.join(staging, SAFE_WEIGHTS_NAME), os.path.join(folder, SAFE_WEIGHTS_NAME))


def uncalibrated_routing(folder, oda_config):
    """``(routing defaults to save, whether folder's oda_config.json is unreadable)`` once a calibration of other
    weights is dropped: the calibrated threshold goes back to the default, as OdaTrainer does.

    `oda_config` None (a head-only save): the folder's own oda_config.json, if any, with the default threshold.
    Given (OdaForCausalLM.save_pretrained): reset only if its threshold is the folder's calibrated one (the model
    was loaded from this folder); a threshold the model was given is the caller's choice and is kept."""
    from .config import ODA_CONFIG_NAME, OdaConfig

    path = os.path.join(folder, ODA_CONFIG_NAME)
    try:
        saved = OdaConfig.from_json_file(path) if os.path.isfile(path) else None
    except (OSError, ValueError):
        return oda_config, oda_config is None
    if oda_config is None:
        return (None if saved is None else OdaConfig.from_kwargs(saved, threshold=OdaConfig().threshold)), False
    if saved is not None and oda_config.threshold == saved.threshold:
        return OdaConfig.from_kwargs(oda_config, threshold=OdaConfig().threshold), False
    return oda_config, False


def pop_push_kwargs(push_to_hub: bool, kwargs: dict) -> dict | None:
    """The upload arguments of a ``save_pretrained(..., push_to_hub=True)`` call (taken out of `kwargs`), or None.
    Never passed on: transformers would push its staging folder, under that folder's random name."""
    if not push_to_hub:
        return None
    return {key: kwargs.pop(key) for key in PUSH_KWARGS if key in kwargs}


def push_published(folder, names, repo_id: str | None = None, commit_message: str | None = None,
                   commit_description: str | None = None, private: bool | None = None,
                   token: bool | str | None = None, create_pr: bool = False, revision: str | None = None):
    """Upload the files `names` a save just published into `folder` to `repo_id` (default: the folder's name), as
    `hub.push_saved_to_hub` does: ODA's model card, not a generic one. Other files of the folder (a kept
    calibration.json, the user's own) are not this save's and stay local."""
    from transformers.utils.hub import hf_api

    from .hub import upload_saved_files

    folder = os.path.abspath(os.fspath(folder))
    repo_id = hf_api().create_repo(repo_id or os.path.basename(folder), private=private, token=token,
                                   exist_ok=True).repo_id
    return upload_saved_files(folder, names, repo_id, commit_message=commit_message, token=token,
                              create_pr=create_pr, revision=revision, commit_description=commit_description)


def register_auto_classes() -> None:
    """Make AutoConfig/AutoModel.from_pretrained(head_folder) return the recall head (idempotent).

    transformers' supported extension API. Importing this module calls it (any oda_hf class does), and so does
    `import oda_hf` when transformers is already imported.
    """
    AutoConfig.register(RecallHeadConfig.model_type, RecallHeadConfig, exist_ok=True)
    AutoModel.register(RecallHeadConfig, RecallHead, exist_ok=True)


register_auto_classes()
