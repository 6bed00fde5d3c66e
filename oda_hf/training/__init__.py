"""Training the recall head: paired-gain supervision (ODA_SPEC section 5) and `OdaTrainer`.

Module map:

* `layout`    - segments, in-segment positions and eligibility of a token batch (no model needed);
* `attention` - three-stream attention (trunk / Local-cf / Full-cf) through transformers' AttentionInterface;
* `deltanet`  - the same for Qwen3.5 Gated DeltaNet layers (call-time forward wrapper, restored afterwards);
* `paired`    - one backbone pass -> access gains, head inputs H/E/L at every eligible position;
* `losses`    - target ``T(g - lambda)``, Huber(1), ``micro``/``step`` reductions;
* `trainer`   - `OdaTrainer` / `OdaTrainingArguments` (head-only atomic checkpoints, checked resume, DDP);
* `data`      - documents -> packed rows -> padded batches; `cli` - ``oda train-head``;
* `supervision_cache` - paired supervision computed once into safetensors shards, `OdaCacheTrainer` over it.
"""

from .data import OdaDataCollator, PackedDataset, min_document_length, pack_documents, read_documents
from .layout import SequenceLayout, build_layout, count_eligible, shift_within_segments
from .losses import microbatch_loss, regression_target, signed_log, token_losses
from .paired import PairedBatch, PairedStreams, paired_streams, paired_supervision, preceding_states, target_logprobs
from .supervision_cache import OdaCacheTrainer, SupervisionCache, SupervisionCacheDataset, cache_supervision
from .trainer import HeadTrainingModule, OdaTrainer, OdaTrainingArguments, last_complete_checkpoint

__all__ = [
    "HeadTrainingModule",
    "OdaCacheTrainer",
    "OdaDataCollator",
    "OdaTrainer",
    "OdaTrainingArguments",
    "PackedDataset",
    "PairedBatch",
    "PairedStreams",
    "SequenceLayout",
    "SupervisionCache",
    "SupervisionCacheDataset",
    "build_layout",
    "cache_supervision",
    "count_eligible",
    "last_complete_checkpoint",
    "microbatch_loss",
    "min_document_length",
    "pack_documents",
    "paired_streams",
    "paired_supervision",
    "preceding_states",
    "read_documents",
    "regression_target",
    "shift_within_segments",
    "signed_log",
    "target_logprobs",
    "token_losses",
]
