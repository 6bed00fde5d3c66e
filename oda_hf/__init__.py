"""oda_hf: On-Demand Attention for Hugging Face Transformers.

A frozen causal LM decodes every token with Local attention (sinks + recent window); a small trained
recall head decides when to recompute the step with Full attention over the complete KV cache.

Public names load on first use (torch and transformers are not imported by ``import oda_hf``).
"""

import sys
from typing import TYPE_CHECKING

from ._lazy import lazy_exports

_EXPORTS = {
    "OdaCache": ".cache",
    "OdaConfig": ".config",
    "RecallHead": ".head",
    "RecallHeadConfig": ".head",
    "OdaForCausalLM": ".modeling",
    "AlwaysFullPolicy": ".policies",
    "AlwaysLocalPolicy": ".policies",
    "BudgetPolicy": ".policies",
    "HeadPolicy": ".policies",
    "RandomPolicy": ".policies",
    "RoutingPolicy": ".policies",
    "SchedulePolicy": ".policies",
    "RoutingRecord": ".routing",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if "transformers" in sys.modules:
    # AutoConfig/AutoModel learn `oda_recall_head` now. Registering needs transformers (and torch), which
    # `import oda_hf` never imports by itself (`oda --help` stays fast); any oda_hf class registers it too.
    from .head import register_auto_classes

    register_auto_classes()

if TYPE_CHECKING:
    from .cache import OdaCache
    from .config import OdaConfig
    from .head import RecallHead, RecallHeadConfig
    from .modeling import OdaForCausalLM
    from .policies import (
        AlwaysFullPolicy,
        AlwaysLocalPolicy,
        BudgetPolicy,
        HeadPolicy,
        RandomPolicy,
        RoutingPolicy,
        SchedulePolicy,
    )
    from .routing import RoutingRecord

__version__ = "0.1.0"

__all__ = [
    "AlwaysFullPolicy",
    "AlwaysLocalPolicy",
    "BudgetPolicy",
    "HeadPolicy",
    "OdaCache",
    "OdaConfig",
    "OdaForCausalLM",
    "RandomPolicy",
    "RecallHead",
    "RecallHeadConfig",
    "RoutingPolicy",
    "RoutingRecord",
    "SchedulePolicy",
]
