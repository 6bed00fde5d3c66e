"""oda_hf.engine: the static decode engine (the fast path) for full-attention families and Gemma 3.

    from oda_hf.engine import OdaStaticEngine
    engine = OdaStaticEngine(model, max_length=4096, batch_size=1)   # model: an OdaForCausalLM
    tokens = engine.generate(input_ids, max_new_tokens=256)           # routing in engine.routing

or ``model.generate(..., oda_fast=True)``. ``ODA_DISABLE_FAST_PATH=1`` turns it off (oda_fast=True then
runs the HF path, logged; building an engine raises). Gemma 3's sliding layers read their native window from
the engine's cache; recurrent hybrids (Qwen3.5) and Gemma 4 run on the HF path.

Modules: `state` (buffers at fixed addresses, commit, warm-up transactions), `attention` (static
Cache facade + the registered attention function), `routing` (device-side decisions), `graphs`
(length buckets, the device-side branch, CUDA-graph capture/replay), `engine` (the step and the
request API), `generation` (generate()-compatible requests), `support` (what is supported).
"""

from .engine import KERNEL_BACKENDS, OdaStaticEngine
from .generation import fast_path_enabled, generate_fast
from .graphs import DEFAULT_BUCKET_SIZE, GraphKey, bucket_columns, bucket_index
from .routing import StepPlan
from .support import DISABLE_ENV, FAST_PATH_MODEL_TYPES, FastPathUnsupported, fast_path_disabled

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "DISABLE_ENV",
    "FAST_PATH_MODEL_TYPES",
    "FastPathUnsupported",
    "GraphKey",
    "KERNEL_BACKENDS",
    "OdaStaticEngine",
    "StepPlan",
    "bucket_columns",
    "bucket_index",
    "fast_path_disabled",
    "fast_path_enabled",
    "generate_fast",
]
