"""Triton kernels for ODA decoding, each with a plain PyTorch reference of the same contract.

* `local_attention_decode` (two kernels: block partials read in place from the sinks + ring
  workspace, then a stable softmax combine) / `local_attention_decode_reference`.
* `full_attention_decode` (split-K Full attention over a static cache's columns with a device-side length,
  merged by the Local kernel's combine) / `full_attention_decode_reference`.
* `fused_commit` (selected current KV of all stacked layers into the full cache and the Local
  workspace, one launch) / `commit_reference`.

Triton is optional: without it the references work and the Triton entry points raise a clear
error. Kernels run on CUDA tensors; with ``TRITON_INTERPRET=1`` set before this package is
imported they run on CPU tensors through Triton's interpreter (for tests on small shapes only).
"""

from ._triton import HAS_TRITON
from .commit import commit_reference, fused_commit, workspace_slot
from .full_attention import (
    SPLIT_POSITIONS,
    allocate_full_scratch,
    full_attention_decode,
    full_attention_decode_reference,
    num_full_splits,
)
from .local_attention import (
    BLOCK_POSITIONS,
    LocalAttentionScratch,
    allocate_local_scratch,
    local_attention_decode,
    local_attention_decode_reference,
    local_visible_slots,
    num_local_blocks,
)


def kernels_interpreted() -> bool:
    """True if the Triton kernels can run on CPU tensors through Triton's interpreter.

    That needs ``TRITON_INTERPRET=1`` to have been set before triton itself was imported (it defines
    part of ``triton.language`` as jit functions) and before this package was.
    """
    if not HAS_TRITON:
        return False
    from ._triton import is_interpreted, triton_library_interpreted
    from .local_attention import _local_partial_kernel

    return is_interpreted(_local_partial_kernel) and triton_library_interpreted()


__all__ = [
    "BLOCK_POSITIONS",
    "HAS_TRITON",
    "LocalAttentionScratch",
    "SPLIT_POSITIONS",
    "allocate_full_scratch",
    "allocate_local_scratch",
    "commit_reference",
    "full_attention_decode",
    "full_attention_decode_reference",
    "fused_commit",
    "kernels_interpreted",
    "local_attention_decode",
    "local_attention_decode_reference",
    "local_visible_slots",
    "num_full_splits",
    "num_local_blocks",
    "workspace_slot",
]
