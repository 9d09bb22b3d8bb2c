"""Golden-logit check: an HF directory run by transformers (PyTorch) against its diffjax conversion.

Both models see the same random prompts. Reported per stage (embeddings, each layer's output, the
final norm): max |diff| and max |diff| / max |reference|; then the logits' differences, the KL
divergence of the next-token distributions KL(torch || diffjax) and top-1 agreement. The check
passes when logits, KL and top-1 agreement are within the tolerance for the dtype.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.convert import formats, hub
from diffjax.convert.common import ConversionError, build_module, flatten
from diffjax.convert.hf import load_detected, read_hf_config
from diffjax.model import layer_outputs
from diffjax.model.transformer import TransformerLM


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logits_rel: float  # max |diff| / max |logit|
    kl_max: float  # max over positions of KL(torch || diffjax), nats
    top1: float  # minimum fraction of positions with the same argmax


# float32: both sides compute the same function; differences are summation order (~1e-6 relative).
# bfloat16: 8 mantissa bits, and diffjax rounds where flash kernels do while HF eager rounds the scores
# first (tests/test_hf_equivalence.py), so the two bf16 runs differ by about a bf16 ulp of the logits.
TOLERANCES = {
    "float32": Tolerance(logits_rel=1e-4, kl_max=1e-6, top1=0.99),
    "bfloat16": Tolerance(logits_rel=6e-2, kl_max=1e-2, top1=0.90),
}


@dataclasses.dataclass
class VerifyResult:
    source: str
    dtype: str
    shape: tuple[int, int]
    stages: list[tuple[str, float, float]]  # (name, max abs diff, max rel diff)
    logits_abs: float
    logits_rel: float
    kl_mean: float
    kl_max: float
    top1: float
    tolerance: Tolerance

    @property
    def failures(self) -> list[str]:
        tol, out = self.tolerance, []
        if not self.logits_rel <= tol.logits_rel:  # `not <=` also catches NaN
            out.append(f"logits max rel diff {self.logits_rel:.3e} > {tol.logits_rel:.1e}")
        if not self.kl_max <= tol.kl_max:
            out.append(f"max KL {self.kl_max:.3e} > {tol.kl_max:.1e}")
        if not self.top1 >= tol.top1:
            out.append(f"top-1 agreement {self.top1:.2%} < {tol.top1:.0%}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def report(self) -> str:
        tol = self.tolerance
        lines = [
            f"verify {self.source}: transformers (PyTorch, eager) vs diffjax, {self.dtype}, "
            f"{self.shape[0]} prompts x {self.shape[1]} tokens",
            f"{'stage':<14} {'max abs diff':>13} {'max rel diff':>13}",
        ]
        lines += [f"{name:<14} {abs_diff:>13.3e} {rel_diff:>13.3e}" for name, abs_diff, rel_diff in self.stages]
        lines += [
            f"{'logits':<14} {self.logits_abs:>13.3e} {self.logits_rel:>13.3e}   (tolerance: rel {tol.logits_rel:.1e})",
            f"KL(torch || diffjax) of next-token distributions: mean {self.kl_mean:.3e}, max {self.kl_max:.3e} nats"
            f"   (tolerance: max {tol.kl_max:.1e})",
            f"top-1 agreement: {self.top1:.2%}   (tolerance: >= {tol.top1:.0%})",
            "PASS" if self.passed else "FAIL: " + "; ".join(self.failures),
        ]
        return "\n".join(lines)


def _diff(ours, reference) -> tuple[float, float]:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    abs_diff = float(np.abs(ours - reference).max())
    return abs_diff, abs_diff / max(float(np.abs(reference).max()), 1e-30)


def _torch_run(src: Path, dtype: str, tokens: np.ndarray, trust_remote_code: bool):
    """Hidden states after the embedding, each decoder layer and the final norm, and the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype), attn_implementation="eager",
                                                 trust_remote_code=trust_remote_code).eval()
    captured: list[np.ndarray] = []

    def keep(_module, _inputs, output):
        output = output[0] if isinstance(output, tuple) else output
        captured.append(output.detach().float().numpy())

    base = model.model
    hooks = [base.embed_tokens.register_forward_hook(keep)]
    hooks += [layer.register_forward_hook(keep) for layer in base.layers]
    hooks.append(base.norm.register_forward_hook(keep))
    with torch.no_grad():
        logits = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    for hook in hooks:
        hook.remove()
    return captured, logits


def _diffjax_run(model: TransformerLM, tokens: np.ndarray):
    """The same stages as _torch_run from one forward of the model: its embedding, each layer's output (the residual
    stream, from the layer output channel: mHC's [B, T, E, D], as Motif 3's) and the final norm's."""
    tokens_BT = jnp.asarray(tokens)
    embedded_BTD = model.embed(tokens_BT, jnp.dtype(model.config.dtype))
    hidden_BTD, _, outputs = model.hidden_states(tokens_BT, outputs=layer_outputs.Request({"stream"}))
    streams = outputs["stream"].value
    stages = [embedded_BTD] + [streams[depth] for depth in range(model.config.num_layers)] + [hidden_BTD]
    return [np.asarray(x.astype(jnp.float32)) for x in stages], np.asarray(model.logits(hidden_BTD), np.float32)


def load_diffjax_as(path, dtype: str) -> TransformerLM:
    """A diffjax run directory / checkpoint as a model whose params and compute are `dtype`."""
    from diffjax.convert.hf_directories import read_run_config
    from diffjax.params_checkpoint import load_params

    _, step_dir, config = read_run_config(path)
    config = config.replace(dtype=dtype, param_dtype=dtype)
    params = flatten(load_params(step_dir))
    return build_module(lambda: TransformerLM(config, rngs=nnx.Rngs(0)), params, config.param_dtype, consume=True)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)  # float64, so that the KL measures the logits, not its own rounding
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_and_top1(reference: np.ndarray, ours: np.ndarray) -> tuple[float, float, float]:
    log_p, log_q = _log_softmax(reference), _log_softmax(ours)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    top1 = float(np.mean(reference.argmax(-1) == ours.argmax(-1)))
    return float(kl.mean()), float(kl.max()), top1


def verify(
    src: str | os.PathLike,
    *,
    diffjax_path: str | os.PathLike | None = None,
    dtype: str = "float32",
    prompts: int = 4,
    seq_len: int = 64,
    seed: int = 0,
    model: TransformerLM | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> VerifyResult:
    """Compare the HF directory or Hub name `src` (at `revision`: diffjax.convert.hub) under transformers with
    diffjax on random prompts.

    The diffjax side is `model` if given, else the run directory / checkpoint `diffjax_path`
    (e.g. the output of hf-to-diffjax), else `src` converted in memory by load_hf. Both run in `dtype`.
    trust_remote_code: let transformers run the modeling code `src` ships (its config.json's auto_map), as models
    transformers does not build in need (Motif's); that executes the directory's Python files.
    """
    if dtype not in TOLERANCES:
        raise ConversionError(f"verify: dtype must be one of {tuple(TOLERANCES)}, got {dtype!r}")
    if prompts < 1 or seq_len < 1:
        raise ConversionError(f"verify: prompts and seq_len must be >= 1, got {prompts} and {seq_len}")
    source, src = str(src), Path(hub.resolve(src, revision=revision, trust_remote_code=trust_remote_code))
    hf = read_hf_config(src)
    fmt = formats.detect(hf)
    if fmt.remote_code and not trust_remote_code:
        raise ConversionError(f"verify: transformers has no {fmt.label} model built in; {source}'s own modeling code "
                              "(its config.json's auto_map) runs with trust_remote_code=True (--trust-remote-code), "
                              "which executes that directory's Python files")
    if model is None:
        model = (load_diffjax_as(diffjax_path, dtype) if diffjax_path is not None
                 else load_detected(src, hf, fmt, dtype=dtype))
    config = model.config
    if config.vocab_size != hf.get("vocab_size") or config.num_layers != hf.get("num_hidden_layers"):
        raise ConversionError(
            f"verify: the diffjax model (vocab_size {config.vocab_size}, {config.num_layers} layers) is not a "
            f"conversion of {source} (vocab_size {hf.get('vocab_size')}, {hf.get('num_hidden_layers')} layers)"
        )
    seq_len = min(seq_len, config.max_seq_len, int(hf.get("max_position_embeddings", seq_len)))
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (prompts, seq_len), dtype=np.int32)
    ref_stages, ref_logits = _torch_run(src, dtype, tokens, trust_remote_code)
    our_stages, our_logits = _diffjax_run(model, tokens)
    names = ["embeddings"] + [f"layer {i}" for i in range(config.num_layers)] + ["final norm"]
    stages = [(name, *_diff(ours, ref)) for name, ours, ref in zip(names, our_stages, ref_stages)]
    kl_mean, kl_max, top1 = _kl_and_top1(ref_logits, our_logits)
    return VerifyResult(
        source=source, dtype=dtype, shape=tokens.shape, stages=stages,
        logits_abs=_diff(our_logits, ref_logits)[0], logits_rel=_diff(our_logits, ref_logits)[1],
        kl_mean=kl_mean, kl_max=kl_max, top1=top1, tolerance=TOLERANCES[dtype],
    )
