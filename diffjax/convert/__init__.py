"""Weight converters between diffjax and the PyTorch references (see SEMANTICS.md §2 and §5)."""

from diffjax.convert.unilm import load_unilm_attention, unilm_attention_state_dict

__all__ = ["load_unilm_attention", "unilm_attention_state_dict"]
