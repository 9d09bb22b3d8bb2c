"""Weight converters between diffjax and the PyTorch references (see SEMANTICS.md sections 2, 4 and 5)."""

from diffjax.convert.hf import config_from_hf, load_hf, params_from_hf
from diffjax.convert.unilm import load_unilm_attention, unilm_attention_state_dict

__all__ = ["config_from_hf", "load_hf", "load_unilm_attention", "params_from_hf", "unilm_attention_state_dict"]
