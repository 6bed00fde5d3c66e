"""Differences between the transformers versions oda_hf supports (>= 5.23).

transformers 5.24 renamed the KV-cache argument of models, mask builders and `generate()`, and the cache field
of model outputs, from ``past_key_values`` to ``cache`` (the old name warns until 5.40). oda_hf passes the cache
under the name the installed version expects, so neither version warns.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

#: The keyword (and output field) under which transformers passes a model's KV cache.
CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{CACHE_ARG: cache}``: pass a cache to a transformers model, mask builder or `generate()`."""
    return {CACHE_ARG: cache}
