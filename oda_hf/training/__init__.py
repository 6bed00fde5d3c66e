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

Public names load on first use (see `oda_hf._lazy`).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "OdaDataCollator": ".data",
    "PackedDataset": ".data",
    "min_document_length": ".data",
    "pack_documents": ".data",
    "read_documents": ".data",
    "SequenceLayout": ".layout",
    "build_layout": ".layout",
    "count_eligible": ".layout",
    "shift_within_segments": ".layout",
    "microbatch_loss": ".losses",
    "regression_target": ".losses",
    "signed_log": ".losses",
    "token_losses": ".losses",
    "PairedBatch": ".paired",
    "PairedStreams": ".paired",
    "paired_streams": ".paired",
    "paired_supervision": ".paired",
    "preceding_states": ".paired",
    "target_logprobs": ".paired",
    "HeadTrainingModule": ".trainer",
    "OdaTrainer": ".trainer",
    "OdaTrainingArguments": ".trainer",
    "CombinedSupervisionCache": ".supervision_cache",
    "OdaCacheTrainer": ".supervision_cache",
    "SupervisionCache": ".supervision_cache",
    "SupervisionCacheDataset": ".supervision_cache",
    "cache_supervision": ".supervision_cache",
    "last_complete_checkpoint": ".trainer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .data import OdaDataCollator, PackedDataset, min_document_length, pack_documents, read_documents
    from .layout import SequenceLayout, build_layout, count_eligible, shift_within_segments
    from .losses import microbatch_loss, regression_target, signed_log, token_losses
    from .paired import (PairedBatch, PairedStreams, paired_streams, paired_supervision, preceding_states,
                         target_logprobs)
    from .trainer import HeadTrainingModule, OdaTrainer, OdaTrainingArguments
    from .supervision_cache import (CombinedSupervisionCache, OdaCacheTrainer, SupervisionCache,
                                    SupervisionCacheDataset, cache_supervision)
    from .trainer import last_complete_checkpoint

__all__ = sorted(_EXPORTS)
