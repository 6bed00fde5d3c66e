"""`oda text-model`: save the text model of a multimodal checkpoint as a text-only causal LM folder.

Many releases ship a language model inside a vision-language checkpoint (e.g. Qwen3.5 as
``Qwen3_5ForConditionalGeneration``). ODA routes text decoding, and its vLLM plugin serves text-only
``*ForCausalLM`` checkpoints; this command writes one: the text config, the language model's weights under the
text class's names (the vision tower is left out), the tokenizer, and the generation config. The folder is
written atomically and checked: on a text-only prompt its logits must equal the multimodal model's.
"""

from __future__ import annotations

import json
import os
import shutil

from .cli_common import UsageError
from .files import output_lock, publish_files, remove_stale_partials, staging_folder

CHECK_TOKENS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def text_model_class(config):
    """The ``*ForCausalLM`` class of `config`'s text model (UsageError when the checkpoint is text-only already or
    transformers has no causal-LM class for its text part)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    text_config = config.get_text_config(decoder=True)
    if text_config is config:
        raise UsageError(f"This checkpoint ({config.model_type!r}) is text-only already: use it as it is.")
    if type(text_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"transformers has no causal-LM class for {type(text_config).__name__} (the text part of "
                         f"{config.model_type!r}); oda text-model cannot extract it.")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]


def extract_text_model(source: str, output: str) -> dict:
    """Write the text model of the multimodal checkpoint `source` to the folder `output`; returns a summary.

    The multimodal model is loaded whole; its language model (``model.language_model``) and output matrix become the
    text class's ``model`` and ``lm_head``. Both models then run a text-only prompt: the logits must be equal, and
    equal again after the folder is loaded back, or nothing is kept."""
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise UsageError(f"{source} has no config.json: give a local multimodal checkpoint folder.")
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"{output} is a file, not a folder: give a new folder for the text model.")
    if os.path.exists(os.path.join(output, "config.json")):
        raise UsageError(f"{output} already holds a model (config.json): give a new folder.")
    held = sorted(name for name in os.listdir(output) if name != ".oda.lock") if os.path.isdir(output) else []
    if held:   # (a killed conversion's files, or the user's: neither is ours to replace or delete)
        raise UsageError(f"{output} is not empty ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}; left by a "
                         "killed conversion?): give a new or empty folder.")
    created = not os.path.exists(output)
    try:
        with output_lock(output, "the text model"):
            # the staging folder of a killed run into `output` (we hold its lock, so none is in use)
            target = os.path.abspath(output)
            remove_stale_partials(os.path.dirname(target), [os.path.basename(target)])
            return _extract(source, output)
    except BaseException:
        if created and os.path.isdir(output) and not os.listdir(output):   # refused: no folder left behind
            os.rmdir(output)
        raise


def _extract(source: str, output: str) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    cls = text_model_class(config)
    names = [name for name in (config.architectures or []) if hasattr(transformers, name)]
    if not names:
        raise UsageError(f"{source}'s architectures {config.architectures} are not transformers classes.")
    whole = getattr(transformers, names[0]).from_pretrained(source, dtype="auto").eval()
    weights = whole.state_dict()
    # Built in the checkpoint's dtype (not cast afterwards: a cast would also round the rotary buffers the checkpoint
    # does not hold, and the check below would compare another model).
    model = AutoModelForCausalLM.from_config(config.get_text_config(decoder=True), dtype=whole.dtype)
    # transformers 5 keeps a multimodal model's language model under model.language_model.
    renamed = {key: key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
               for key in model.state_dict()}
    missing = [key for key, name in renamed.items() if name not in weights]
    if missing:
        raise UsageError(f"{source} has no language-model weights {[renamed[k] for k in missing[:3]]} (of "
                         f"{len(missing)} missing) where {cls.__name__} needs them: oda text-model cannot extract it.")
    model.load_state_dict({key: weights[name] for key, name in renamed.items()})
    model.tie_weights()
    model.generation_config = whole.generation_config
    model.eval()
    ids = torch.arange(3, 3 + CHECK_TOKENS)[None] % model.config.vocab_size
    with torch.no_grad():
        expected = whole(input_ids=ids).logits.float()
        _check_equal(expected, model(ids).logits.float(), "the extracted text model's")
    del whole, weights  # the multimodal model is not needed past this point (memory for the reload check below)
    staging = staging_folder(output)
    try:
        model.save_pretrained(staging)
        # Only a tokenizer the checkpoint has: transformers would otherwise build an empty one from the model type.
        tokenizer = any(os.path.isfile(os.path.join(source, name)) for name in TOKENIZER_FILES)
        if tokenizer:
            text_tokenizer = AutoTokenizer.from_pretrained(source)
            processor_template = os.path.join(source, "chat_template.json")   # a processor's, which it does not read
            if getattr(text_tokenizer, "chat_template", None) is None and os.path.isfile(processor_template):
                with open(processor_template, encoding="utf-8") as f:
                    text_tokenizer.chat_template = json.load(f).get("chat_template")
            text_tokenizer.save_pretrained(staging)
        with torch.no_grad():
            _check_equal(expected, cls.from_pretrained(staging, dtype="auto").eval()(ids).logits.float(),
                         "the saved text model's")
        publish_files(staging, output, marker="config.json")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"architecture": cls.__name__, "model_type": model.config.model_type, "tokenizer": tokenizer,
            "parameters": sum(p.numel() for p in model.parameters())}


def _check_equal(expected, got, what: str) -> None:
    difference = float((expected - got).abs().max())
    if difference != 0.0:
        raise ValueError(f"On a text-only prompt {what} logits differ from the multimodal model's by "
                         f"{difference:.3g}: nothing was kept (this checkpoint's text path is not its text model's; "
                         "e.g. Gemma 3's final_logit_softcapping, which the multimodal class does not apply).")


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "text-model", help="save the text model of a multimodal checkpoint as a text-only causal LM folder",
        description="Writes the language model of a vision-language checkpoint (e.g. Qwen3_5ForConditionalGeneration) "
                    "as a text-only *ForCausalLM folder with its tokenizer: what ODA's vLLM plugin serves. On a text "
                    "prompt the folder's logits must equal the multimodal model's, or nothing is kept.")
    parser.add_argument("source", help="the multimodal checkpoint folder")
    parser.add_argument("output", help="a new folder for the text model")
    parser.set_defaults(func=run_text_model)


def run_text_model(args) -> int:
    try:
        summary = extract_text_model(args.source, args.output)
    except ValueError as err:   # (a text path that differs: one line, as the other refusals)
        raise UsageError(str(err)) from None
    note = "" if summary["tokenizer"] else " (no tokenizer in the source: add one before serving)"
    print(f"{os.path.abspath(args.output)}: {summary['architecture']} ({summary['parameters']:,} parameters){note}")
    return 0
