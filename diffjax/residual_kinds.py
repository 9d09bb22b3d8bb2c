"""The residual forms: how a decoder block's two sublayers join the residual stream, one row each (jax-free;
diffjax.kinds says what the tables share). A form is a row here plus one module (a subclass of
`diffjax.model.residual.ResidualForm`: the stream's shape, how a sublayer reads it and writes back to it, and
how the model's embedding becomes a stream and a stream the final hidden state).
  plain   the pre-norm Transformer's x + sublayer(norm(x))
  mhc     manifold-constrained hyper-connections (arXiv:2512.24880, as Motif 3 runs them): `streams` parallel
          residual streams mixed around each sublayer by a doubly stochastic matrix (diffjax.model.residual.mhc)
"""

from __future__ import annotations

import dataclasses

from diffjax import kinds

ResidualKind = kinds.PartKind  # a row: name, label, module, params and matmul_params (default 0), options, training

TABLE: kinds.Table[ResidualKind] = kinds.Table("residual")
register, unregister, get, names = TABLE.register, TABLE.unregister, TABLE.get, TABLE.names

register(ResidualKind(name="plain", label="residual", module="diffjax.model.residual:PlainResidual"))


@dataclasses.dataclass(frozen=True)
class MHCOptions(kinds.Options):
    """mHC's settings; Motif 3's config names in parentheses, the defaults are Motif 3's (vLLM's MotifMHCLayer)."""

    streams: int = 4
    """Parallel residual streams E (mhc_expansion_rate)."""
    sinkhorn_iters: int = 20
    """Rounds of row-then-column normalization of h_res (mhc_sinkhorn_iters)."""
    h_post_alpha: float = 0.0
    """h_post = (1 + h_post_alpha) sigmoid(...) (mhc_h_post_alpha_end; the paper: 1.0)."""
    gate_clamp: float = 10.0
    """h_pre's and h_post's pre-sigmoid arguments are clamped to [-gate_clamp, gate_clamp]."""
    sinkhorn_clamp: float = 20.0
    """h_res's logits are clamped to [-sinkhorn_clamp, sinkhorn_clamp] before exp."""
    sinkhorn_eps: float = 1e-8
    """Floor of each row / column sum."""
    norm_eps: float = 1e-6
    """Epsilon of the RMSNorm of the flattened streams (not the model's norm_eps)."""
    identity_init: bool = False
    """Init only (mhc_identity_init): h_res the identity, h_pre 1/streams, h_post 1/2; false: vLLM's default (small
    random gates, h_res near uniform)."""

    def problems(self, config) -> list[str]:
        problems = kinds.positive_int_problems(self, "streams", "sinkhorn_iters")
        for name in ("gate_clamp", "sinkhorn_clamp", "sinkhorn_eps", "norm_eps"):
            value = getattr(self, name)
            if not value > 0:
                problems.append(f"{name} must be positive, got {value!r}")
        if not self.h_post_alpha > -1:
            problems.append(f"h_post_alpha must be greater than -1 (h_post's coefficient is 1 + h_post_alpha), "
                            f"got {self.h_post_alpha!r}")
        return problems

    def describe(self) -> str:
        return f"{self.streams} streams, {self.sinkhorn_iters} Sinkhorn iterations"


def _mhc_matmul_params(c) -> int:
    E = c.residual_options.streams
    # per sublayer, h_pre's, h_post's and h_res's projections of the E D flattened streams (mixing the streams by
    # h_res and weighting them by h_pre multiply activations, not parameters: uncounted, as the norms are)
    return 2 * E * c.d_model * (2 * E + E * E)


def _mhc_params(c) -> int:
    E = c.residual_options.streams
    return _mhc_matmul_params(c) + 2 * (E * c.d_model + 2 * E + E * E + 3)  # + norm scale, biases, 3 alphas


register(ResidualKind(
    name="mhc", label="mHC", module="diffjax.model.residual.mhc:MHCResidual", options=MHCOptions,
    params=_mhc_params, matmul_params=_mhc_matmul_params,
    activation_width=lambda c: c.residual_options.streams * c.d_model,  # E streams of the residual
    # its gates' biases and scales are spared weight decay (decay would pull the stream mix toward uniform)
    training=kinds.Training(no_decay=(r"residual\.(pre|post|res)_(bias|alpha)",)),
))
