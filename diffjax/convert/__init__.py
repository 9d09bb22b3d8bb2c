"""Weight converters between diffjax and the PyTorch references (microsoft/unilm `Diff-Transformer/`, transformers' DiffLlama).
Each Hugging Face checkpoint format is a row of diffjax.convert.formats, defined by its family's module.

Command line: `diffjax-convert {hf-to-diffjax, diffjax-to-hf, upcycle, merge-lora, verify}` (README, "Convert").
"""

from diffjax.convert.hf_directories import diffjax_to_hf, hf_to_diffjax
from diffjax.convert.common import ConversionError
from diffjax.convert.export import hf_config, save_hf
from diffjax.convert.hf import config_from_hf, load_hf, params_from_hf
from diffjax.convert.upcycle import upcycle, upcycle_directory
from diffjax.convert.unilm import load_unilm_attention, unilm_attention_state_dict, unilm_window_size, window_from_unilm
from diffjax.convert.verify import verify

__all__ = [
    "ConversionError", "config_from_hf", "diffjax_to_hf", "hf_config", "hf_to_diffjax", "load_hf",
    "load_unilm_attention", "params_from_hf", "save_hf", "unilm_attention_state_dict", "unilm_window_size", "upcycle",
    "upcycle_directory", "verify",
    "window_from_unilm",
]
