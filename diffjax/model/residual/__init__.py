"""The residual forms' modules (diffjax.residual_kinds is their table): how a decoder block's sublayers read the
residual stream and write back to it.

A form is a ResidualForm subclass; a block holds one instance per sublayer (attn_residual, mlp_residual), and the
model calls the class's `expand` on the embedding and `collapse` before the final norm:
  stream_axes                   the stream's logical axes (the plain stream is [B, T, D])
  expand(config, x_BTD)         (classmethod) the embedding as a stream
  read(stream) -> (x_BTD, carry)     the sublayer's input (before its norm) and what `write` needs of the stream
  write(stream, y_BTD, carry)   the stream after the sublayer's output y joined it
  collapse(config, stream)      (classmethod) the stream as the final hidden state [B, T, D]
"""

from __future__ import annotations

from flax import nnx

from diffjax import kinds, residual_kinds
from diffjax.config import ModelConfig

BTD = ("batch", "length", "act_embed")


class ResidualForm(nnx.Module):
    """One sublayer's connection to the residual stream (module docstring)."""

    stream_axes = BTD

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        pass

    @classmethod
    def expand(cls, config: ModelConfig, x_BTD):
        return x_BTD

    @classmethod
    def collapse(cls, config: ModelConfig, stream):
        return stream

    def read(self, stream):
        raise NotImplementedError

    def write(self, stream, y_BTD, carry):
        raise NotImplementedError


class PlainResidual(ResidualForm):
    """The pre-norm Transformer's: the sublayer reads the stream and adds its output to it (no parameters)."""

    def read(self, x_BTD):
        return x_BTD, None

    def write(self, x_BTD, y_BTD, carry):
        return x_BTD + y_BTD


def module_class(config: ModelConfig) -> type[ResidualForm]:
    return kinds.module_class(residual_kinds.get(config.residual), ResidualForm)
