"""vLLM model classes omni registers in place of vLLM's own (procs.MODEL_OVERRIDES).

Imported only inside vLLM's processes, by the registry, when it builds or inspects the model.
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration


class Qwen25OmniThinker(Qwen2_5OmniThinkerForConditionalGeneration, SupportsEagle3):
    """vLLM's Qwen2.5-Omni thinker declaring the EAGLE-3 aux hidden-state interface: its Qwen2
    decoder already collects the rows of the layers asked for (index k: the residual stream
    entering layer k; num_hidden_layers: the last layer's output before the final norm) and its
    forward returns them, so `extract_hidden_states` can capture them (hidden.py)."""
