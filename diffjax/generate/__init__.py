"""Text generation with a KV cache: `diffjax.generate(model, tokens, max_new_tokens, ...)`.

`diffjax.generate` is this package, and calling it calls `diffjax.generate.generate` (the module is made
callable), so the Python API, `from diffjax.generate import generate, sample` and the CLI
`diffjax-generate --checkpoint DIR --prompt TEXT` all go by the one name.
"""

from __future__ import annotations

import sys
import types

from diffjax.generate.generation import generate, sample
from diffjax.generate.sampling import Sampling, filter_logits, next_tokens


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Sampling", "filter_logits", "generate", "next_tokens", "sample"]
