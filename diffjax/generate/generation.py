"""`diffjax.generate(model, tokens, max_new_tokens, ...)` and `sample`: a call's inputs checked (prompts batched and
right-padded, sizes, sampling, stop tokens), its step picked (plain, or speculative with draft="mtp") and placed
(params and prompts on a mesh), then the decode loop (diffjax.generate.decode) run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from diffjax import sharding
from diffjax.generate import decode
from diffjax.generate.sampling import Sampling
from diffjax.generate.speculative import MTPDraft


def _prompt_batch(tokens, lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [B, P] int32, right-padded; lengths [B] int32) from an array [B, P] (+ lengths) or a list
    of 1-D sequences of any lengths."""
    if isinstance(tokens, (list, tuple)) and lengths is None:
        rows = [np.asarray(row) for row in tokens]
        if not rows or any(row.ndim != 1 for row in rows):
            raise ValueError("tokens must be an array [batch, length] or a non-empty list of 1-D token sequences")
        lengths = np.array([row.size for row in rows])
        dtype = np.result_type(*(row.dtype for row in rows if row.size)) if lengths.any() else np.int32
        prompts = np.zeros((len(rows), max(lengths)), dtype)
        for prompt, row in zip(prompts, rows):
            prompt[: row.size] = row
    else:
        prompts = np.asarray(tokens)
        if prompts.ndim != 2 or prompts.shape[0] == 0:
            raise ValueError(f"tokens must be an array [batch, length] (one row per prompt), got shape {prompts.shape}")
        lengths = np.full(prompts.shape[0], prompts.shape[1]) if lengths is None else np.asarray(lengths)
    if not np.issubdtype(prompts.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {prompts.dtype}")
    if lengths.shape != prompts.shape[:1] or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be integers, one per prompt ({prompts.shape[0]}), got {lengths!r}")
    if lengths.min() < 1 or lengths.max() > prompts.shape[1]:
        raise ValueError(f"every prompt needs 1 to {prompts.shape[1]} tokens (the padded length), got lengths {lengths.tolist()}")
    real = np.arange(prompts.shape[1])[None, :] < lengths[:, None]
    bad = real & ((prompts < 0) | (prompts >= vocab_size))
    if bad.any():
        row, column = np.argwhere(bad)[0]
        raise ValueError(f"token id {int(prompts[row, column])} (prompt {row}, position {column}) is outside the "
                         f"model's vocabulary [0, {vocab_size})")
    return np.where(real, prompts, 0).astype(np.int32), lengths.astype(np.int32)


def generate(model, tokens, max_new_tokens: int, *, lengths=None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens: Sequence[int] = (), pad_id: int | None = None, key=None,
             mesh: Mesh | None = None, on_tokens: Callable[[int, np.ndarray], bool | None] | None = None,
             allowed_vocab_size: int | None = None, blocked_ids: Sequence[int] = (), draft: str | None = None,
             acceptance: list | None = None, timings: list | None = None) -> np.ndarray:
    """`max_new_tokens` new tokens per prompt, int32 [B, max_new_tokens].

    tokens: an int array [B, P] (with `lengths` [B]: row b's prompt is tokens[b, :lengths[b]], the rest
    ignored) or a list of B 1-D sequences of any lengths. temperature 0 (the default) is greedy; otherwise
    `key` is needed, and top_k / top_p filter the tempered distribution (diffjax.generate.sampling). A row
    stops after it produces one of `stop_tokens`; its later positions hold `pad_id` (default: the first stop
    token). mesh: place the params by the sharding rules and split the prompts over the mesh's batch axes
    (data parallel generation); without one, the params stay where they are.
    on_tokens: streaming: called as on_tokens(step, tokens [B]) with each step's tokens as they come off the
    device (step 0 first; pad_id for stopped rows); returning False stops generation there (the rest of the
    result stays pad_id), and an exception it raises stops it and is raised here.
    allowed_vocab_size: only ids below it are generated (pass the tokenizer's vocab_size when the model's
    vocabulary is padded past it); None: any id of the model's vocabulary. blocked_ids: ids never generated either
    (the tokenizer's undecodable_ids()).
    draft "mtp": self-speculative decoding (the decode loop's step diffjax.generate.speculative.MTPDraft): the model's
    MTP depths draft, the model verifies; the same tokens as greedy decoding (greedy only; no on_tokens). acceptance:
    a list that gets the call's speculative.Acceptance appended (drafted, accepted, verify steps).
    timings: a list that gets the call's decode.Timing appended: its program is then compiled before it runs (not
    within the call), so the compilation's seconds and the generation's are apart.
    Prompt + new tokens must fit the model's max_seq_len. While it runs, generation holds a per-layer copy of
    the blocks' params (TransformerLM.unstacked_blocks: what makes a decode step read each weight once).
    """
    config = model.config
    prompts_BP, lengths_B = _prompt_batch(tokens, lengths, config.vocab_size)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    max_len = prompts_BP.shape[1] + max_new_tokens
    if max_len > config.max_seq_len:
        raise ValueError(f"prompt ({prompts_BP.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds "
                         f"the model's max_seq_len {config.max_seq_len}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be a function (step, tokens) -> bool | None, got {on_tokens!r}")
    if allowed_vocab_size is not None and allowed_vocab_size >= config.vocab_size:
        allowed_vocab_size = None  # every id: the same compiled program as without
    sampling = Sampling(temperature, top_k, top_p, allowed_vocab_size, tuple(sorted(int(i) for i in blocked_ids)))
    if key is None:
        if not sampling.greedy:
            raise ValueError(f"temperature {temperature} samples: pass key=jax.random.key(seed) (or temperature=0 for greedy)")
        key = jax.random.key(0)  # unused by greedy decoding
    stop_tokens = tuple(int(t) for t in stop_tokens)
    for token in stop_tokens + (() if pad_id is None else (pad_id,)):
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"stop / pad token {token} is outside the model's vocabulary [0, {config.vocab_size})")
    choice = decode.Choice(sampling, stop_tokens, stop_tokens[0] if pad_id is None and stop_tokens else int(pad_id or 0))
    _check_draft(draft, config, sampling, on_tokens)

    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    prompts, row_lengths = jnp.asarray(prompts_BP), jnp.asarray(lengths_B)
    if mesh is not None:
        params = jax.device_put(params, sharding.param_shardings(nnx.state(model, nnx.Param), mesh))
        prompts = jax.device_put(prompts_BP, NamedSharding(mesh, sharding.logical_spec(("batch", None), prompts_BP.shape, mesh)))
        row_lengths = jax.device_put(lengths_B, NamedSharding(mesh, sharding.logical_spec(("batch",), lengths_B.shape, mesh)))
    step = decode.PLAIN if draft is None else MTPDraft(config.mtp_depths)
    decoded = decode.run(graphdef, params, prompts, row_lengths, key, max_len=max_len, max_new_tokens=max_new_tokens,
                         choice=choice, mesh=mesh, on_tokens=on_tokens, step=step, timings=timings)
    if acceptance is not None and draft is not None:
        acceptance.append(decoded.summary)
    return decoded.tokens_BN


def _check_draft(draft, config, sampling: Sampling, on_tokens) -> None:
    """One-line refusals of a speculative call decoding cannot make."""
    if draft is None:
        return
    if draft != "mtp":
        raise ValueError(f"draft must be None or 'mtp' (the model's MTP depths draft), got {draft!r}")
    if not config.mtp_depths:
        raise ValueError("draft='mtp' needs a model with MTP depths (ModelConfig.mtp_depths is 0)")
    if not sampling.greedy:
        raise ValueError(f"draft='mtp' decodes greedily: temperature must be 0, got {sampling.temperature}")
    if on_tokens is not None:
        raise ValueError("draft='mtp' does not stream: pass no on_tokens")


def sample(model, prompt_ids, num_tokens: int, *, key, temperature: float = 0.8, **options) -> np.ndarray:
    """`num_tokens` ids sampled after one prompt (1-D; temperature 0: greedy); options as for `generate`."""
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0:
        raise ValueError("sample needs a prompt of at least one token")
    return generate(model, prompt[None], num_tokens, temperature=temperature, key=key, **options)[0]
