"""diffjax models in EleutherAI's lm-evaluation-harness: `DiffjaxLM`, registered with lm_eval as "diffjax".

    lm_eval.simple_evaluate(model="diffjax", model_args={"pretrained": PATH}, tasks=[...])   # after importing this
    lm_eval.simple_evaluate(model=DiffjaxLM(pretrained=PATH, batch_size=16), tasks=[...])

Requests are scored as lm_eval's Hugging Face backend (HFLM, lm_eval/models/huggingface.py) scores them, so the
numbers compare with `--model hf` on the same weights (tests/test_lm_eval.py checks it on converted DiffLlama and
Llama models):

* loglikelihood: context and continuation tokenized as HFLM does (TemplateLM._encode_pair: the whole string and
  the context, the continuation = the tokens past the context's), input = (context + continuation)[-(max_length
  + 1):][:-1] (truncated from the left), the continuation's log-probs summed, greedy = every continuation token
  is the argmax. Requests sharing context + continuation[:-1] share one forward pass (HFLM's logits cache:
  multiple choice with one-token answers costs one row per question).
* loglikelihood_rolling: lm_eval.utils.get_rolling_token_windows over the document (prefix token, max_length,
  context_len 1), each window a loglikelihood request, summed.
* generate_until: the contexts' last max_length - max_gen_toks tokens, diffjax's KV-cached decoding (greedy
  unless the task samples), stopped by the tokenizer's eos or once every row holds a stop string; the text is
  cut at the first stop string (lm_eval's postprocess_generated_text).

Batches are right-padded to a few lengths (powers of two from 32, then multiples of 512, capped at max_length)
and to `batch_size` rows, so each jitted program compiles once per length bucket. Tokens: the checkpoint's own
tokenizer (a conversion's tokenizer.json, config.yaml's data.tokenizer, or `tokenizer=`); a Hugging Face
tokenizer.json encodes with its post-processor (a Llama tokenizer's BOS), as transformers does by default
(`add_bos_token=` overrides, as HFLM's does).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from diffjax import sharding, storage
from diffjax.ops.context_parallel import context_order, context_size, to_context_order
from diffjax.config_values import build_config
from diffjax.generate.decode import to_host
from diffjax.mesh_axes import MESH_AXES, ParallelConfig
from diffjax.train.mesh import check_model_fits_mesh, make_mesh

log = logging.getLogger("diffjax.eval")

MIN_BUCKET = 32  # the shortest padded length; then powers of two up to LONG_BUCKET, then its multiples
LONG_BUCKET = 512
STOP_CHECK_EVERY = 8  # decode steps between checks of "every row has finished" (eos or a stop string: detokenizes)
_SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks"}


# --- loading -----------------------------------------------------------------------------------------


def parse_mesh(spec: str | Mesh | None) -> Mesh | None:
    """The trainer's mesh (diffjax.train.mesh: axes data, fsdp, context, tensor) from "data=4,tensor=2" (or
    "data:4/tensor:2", which fits in lm_eval's comma-separated model_args): axes not named have size 1, one size
    may be -1 (the devices left); without a -1 the mesh takes the first devices it needs. A context axis splits
    each scored sequence (generation takes none). None or a Mesh: returned as is."""
    if spec is None or isinstance(spec, Mesh):
        return spec
    sizes = {}
    for part in filter(None, re.split(r"[,/;\s]+", str(spec).strip())):
        name, _, size = part.replace(":", "=").partition("=")
        if name not in MESH_AXES or not size or name in sizes:
            raise ValueError(f"mesh {spec!r}: expected axis=size items, each of the axes {MESH_AXES} at most once "
                             f"(e.g. data=4,tensor=2); got {part!r}")
        sizes[name] = size
    if not sizes:
        raise ValueError(f"mesh {spec!r}: name at least one axis (e.g. data=4,tensor=2)")
    try:  # the trainer's checks: integer sizes, positive or one -1
        config = build_config(ParallelConfig, {axis: 1 for axis in MESH_AXES} | sizes)
    except ValueError as error:
        raise ValueError(f"mesh {spec!r}: {error}") from None
    devices, shape = jax.devices(), [getattr(config, axis) for axis in MESH_AXES]
    fixed, fill = math.prod(size for size in shape if size != -1), -1 in shape
    if fixed > len(devices) or (fill and len(devices) % fixed):
        raise ValueError(f"mesh {spec!r} does not fit the {len(devices)} devices")
    return make_mesh(config, devices if fill else devices[:fixed])


def _load_run(step_dir: Path, mesh: Mesh | None, what: str):
    """The TransformerLM of a checkpoint; under a mesh each array is read straight into its shards."""
    from diffjax.model import TransformerLM
    from diffjax.params_checkpoint import load_model, load_model_params, saved_model_config

    if mesh is None:
        return load_model(step_dir, what=what)
    config = saved_model_config(step_dir, what=what)
    _check_fits(config, mesh)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    shardings = sharding.param_shardings(abstract, mesh)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nnx.to_pure_dict(abstract),
                          shardings)
    nnx.replace_by_pure_dict(abstract, load_model_params(step_dir, target, what=what))  # a LoRA run: merged
    return nnx.merge(graphdef, abstract)


def _check_fits(config, mesh: Mesh) -> None:
    """The trainer's check that the model splits over the mesh (whole heads over tensor, whole experts over expert),
    as one line naming the mesh, instead of shard_map's error when the first batch is scored."""
    try:
        check_model_fits_mesh(config, mesh)
    except ValueError as error:
        axes = ",".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1)
        raise ValueError(f"mesh {axes}: {str(error).replace('parallel.', '')}") from None


def _run_tokenizer(step_dir: Path):
    from diffjax.generate.__main__ import load_tokenizer  # the generate CLI's: config.yaml's data.tokenizer

    try:
        return load_tokenizer(step_dir)
    except ValueError as error:  # its suggestion is the generate CLI's
        raise ValueError(str(error).replace("or pass --prompt-ids", "or pass tokenizer=PATH")) from None


def load_for_eval(path, *, dtype: str | None = None, mesh: Mesh | None = None, tokenizer=None, what: str = "pretrained",
                  revision: str | None = None):
    """(TransformerLM, Tokenizer) of any checkpoint diffjax loads: a Hugging Face directory (config.json and
    weights: DiffLlama, Llama, Motif) or Hub name org/name at `revision` (diffjax.convert.hub), or a diffjax run
    directory, its checkpoints/ directory or one step directory (train.py's or a conversion's).

    dtype: compute and parameter dtype (None: the checkpoint's). mesh: params placed by diffjax.sharding's rules
    (a run directory's read shard by shard). tokenizer: a Tokenizer, a tokenizer.json or the directory holding
    one, or "byte"; None: the checkpoint's own (an HF directory's tokenizer.json, config.yaml's data.tokenizer)."""
    from diffjax.convert.hub import resolve
    from diffjax.tokenizers import HFTokenizer

    path = storage.as_path(resolve(path, revision=revision))  # a local path or gs://
    if (path / "config.json").is_file():  # a Hugging Face directory (a run directory has config.yaml instead)
        from diffjax.convert import load_hf

        model, own_tokenizer = load_hf(path), functools.partial(HFTokenizer, path)
        if mesh is not None:
            _check_fits(model.config, mesh)
            state = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(state, jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh)))
            nnx.update(model, state)
    else:
        from diffjax.params_checkpoint import resolve_checkpoint

        step_dir = resolve_checkpoint(path, what)
        model, own_tokenizer = _load_run(step_dir, mesh, what), functools.partial(_run_tokenizer, step_dir)
    return with_dtype(model, dtype), own_tokenizer() if tokenizer is None else tokenizer_from(tokenizer)


def tokenizer_from(spec):
    """A diffjax Tokenizer as is; "byte": the byte tokenizer; else a tokenizer.json or the directory holding one."""
    from diffjax.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

    if isinstance(spec, Tokenizer):
        return spec
    return ByteTokenizer() if str(spec) == "byte" else HFTokenizer(spec)


def with_dtype(model, dtype: str | None):
    """`model` computing and keeping its params in `dtype` (None, or the model's own: `model` itself)."""
    from diffjax.model import TransformerLM

    config = model.config
    if dtype is None or (dtype, dtype) == (config.dtype, config.param_dtype):
        return model
    config = config.replace(dtype=dtype, param_dtype=dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x.astype(dtype), nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    return nnx.merge(graphdef, state)


# --- the jitted programs -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"))
def _score(graphdef, params, tokens_BT, lengths_B, *, mesh):
    """For right-padded rows: log p(tokens[t + 1] | tokens[:t + 1]) [B, T], the argmax token at each position
    [B, T] and the whole log-softmax at each row's last position [B, V] (float32). Under a context axis the model
    reads the sequence in its layout (ops.context_parallel): the tokens go in so, the logits come back in order."""
    context = 1 if mesh is None else context_size(mesh)
    with sharding.activation_sharding(mesh):
        logits_BTV = nnx.merge(graphdef, params)(to_context_order(tokens_BT, context)).astype(jnp.float32)
    if context > 1:
        logits_BTV = jnp.take(logits_BTV, jnp.asarray(np.argsort(context_order(tokens_BT.shape[1], context))), axis=1)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    next_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros_like(tokens_BT[:, :1])], axis=1)
    next_logp_BT = jnp.take_along_axis(logits_BTV, next_BT[..., None], axis=-1)[..., 0] - lse_BT
    last_BV = jnp.take_along_axis(logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    last_BV = last_BV - jnp.take_along_axis(lse_BT, (lengths_B - 1)[:, None], axis=1)
    return next_logp_BT, jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32), last_BV


def length_bucket(length: int, cap: int, multiple: int = 1) -> int:
    """The padded length of a batch whose longest row has `length` tokens: a power of two from MIN_BUCKET up
    to LONG_BUCKET, then a multiple of LONG_BUCKET; rounded up to a multiple of `multiple` (a context axis's
    2 x context chunks); at most `cap`."""
    bucket = max(MIN_BUCKET, 1 << (length - 1).bit_length()) if length <= LONG_BUCKET else -(-length // LONG_BUCKET) * LONG_BUCKET
    return min(-(-bucket // multiple) * multiple, cap)


@dataclasses.dataclass
class _Row:
    """One forward row: the input tokens and the requests it scores (request index, continuation length,
    the continuation's last token)."""

    tokens: tuple[int, ...]
    requests: list[tuple[int, int, int]]


@register_model("diffjax")
class DiffjaxLM(TemplateLM):
    """An lm_eval model for diffjax checkpoints (see the module docstring).

    pretrained: a path or Hub name load_for_eval reads (revision: a Hub name's); or model= a TransformerLM and
    tokenizer= its Tokenizer (pretrained then only names it in the results).
    batch_size: rows per forward pass (and per generation batch); max_length: the context the model sees
    (default and cap: the model's max_seq_len); max_gen_toks: generation's default budget (a task's
    generation_kwargs override it); dtype: "float32" / "bfloat16" (default: the checkpoint's); mesh: a Mesh or
    "data=4,tensor=2" / "data:4/tensor:2" (`parse_mesh`: batches split over data x fsdp, params by
    diffjax.sharding's rules, each scored sequence over context); add_bos_token / prefix_token_id: as HFLM's
    (None: the tokenizer's default / bos, else eos); seed: sampled generation's key. device and max_batch_size
    (lm_eval passes them to every model) are ignored: JAX places the work.
    """

    def __init__(self, pretrained: str | None = None, *, model=None, tokenizer=None, batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, dtype: str | None = None, mesh=None,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None, seed: int = 1234,
                 device: str | None = None, max_batch_size: int | None = None, revision: str | None = None,
                 **unknown):
        super().__init__()
        if unknown:
            raise TypeError(f"DiffjaxLM got unknown model_args {sorted(unknown)}; known: pretrained, revision, "
                            "tokenizer, batch_size, max_length, max_gen_toks, dtype, mesh, add_bos_token, "
                            "prefix_token_id, seed")
        if not (isinstance(batch_size, int) or str(batch_size).isdigit()) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer (no 'auto': pick the rows per forward pass), got {batch_size!r}")
        if max_length is not None and not (isinstance(max_length, int) and 2 <= max_length):
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        self.mesh = parse_mesh(mesh)
        self.context = 1 if self.mesh is None else context_size(self.mesh)
        if self.mesh is not None:
            rows = sharding.batch_shards(self.mesh)
            if int(batch_size) % rows:
                raise ValueError(f"batch_size {batch_size} must be a multiple of the mesh's data x fsdp x expert ({rows})")
        if model is None:
            if pretrained is None:
                raise ValueError("DiffjaxLM needs pretrained=PATH (a run directory, checkpoint or Hugging Face directory) "
                                 "or model= and tokenizer=")
            model, tokenizer = load_for_eval(pretrained, dtype=dtype, mesh=self.mesh, tokenizer=tokenizer,
                                             revision=revision)
        elif tokenizer is None:
            raise ValueError("DiffjaxLM(model=...) needs tokenizer= (a diffjax Tokenizer, a tokenizer.json or 'byte')")
        else:
            tokenizer = tokenizer_from(tokenizer)
        model = with_dtype(model, dtype)
        self.pretrained = None if pretrained is None else str(pretrained)
        self.config = model.config
        self.graphdef, state = nnx.split(model)
        self.params = nnx.to_pure_dict(state)
        if self.mesh is not None:  # (a no-op for params load_for_eval placed)
            self.params = jax.device_put(self.params, sharding.param_shardings(nnx.state(model, nnx.Param), self.mesh))
        self.tokenizer = tokenizer
        if tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(f"the tokenizer ({tokenizer.name}, {tokenizer.vocab_size} ids) does not fit the model's "
                             f"vocabulary ({self.config.vocab_size})")
        self._rust = None  # a Hugging Face tokenizer.json: encoded with its post-processor, as transformers does
        from diffjax.tokenizers import HFTokenizer

        if isinstance(tokenizer, HFTokenizer):
            from tokenizers import Tokenizer as RustTokenizer

            self._rust = RustTokenizer.from_file(tokenizer.path)
        self.batch_size_per_gpu = int(batch_size)
        self._max_length = min(max_length or self.config.max_seq_len, self.config.max_seq_len)
        if self.context > 1 and self._max_length % (2 * self.context):
            raise ValueError(f"max_length {self._max_length} must be a multiple of 2 x the mesh's context "
                             f"({2 * self.context}): a context axis splits each sequence into that many chunks")
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.seed = int(seed)
        self.batch_sizes = {}

    # --- what lm_eval asks of a model

    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_id is None:
            raise ValueError(f"the tokenizer {self.tokenizer.name} has no eos token: pass prefix_token_id=ID")
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on: HFLM's choice (bos, else eos)."""
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def device(self):
        return str(jax.devices()[0].platform)

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name.replace("/", "__")

    def get_model_info(self) -> dict:
        return {"model_path": self.pretrained, "model_dtype": self.config.dtype, "model_attention": self.config.attention,
                "model_num_parameters": int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.params)))}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """HFLM.tok_encode's: special tokens as the flag (else add_bos_token, else the tokenizer's default) says,
        none when the text already starts with the prefix token's text."""
        add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if self._rust is not None:
            if add_special_tokens is None and string.startswith(self._prefix_text):
                add = False
            ids = self._rust.encode(string, add_special_tokens=True if add is None else add).ids
        else:  # byte / sentencepiece / tiktoken: no special tokens unless asked for
            ids = [int(i) for i in self.tokenizer.encode(string)]
            if add and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    @functools.cached_property
    def _prefix_text(self) -> str:
        return self._rust.decode([self.prefix_token_id], skip_special_tokens=False)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [int(t) for t in np.atleast_1d(np.asarray(tokens))]
        if self._rust is not None:
            return self._rust.decode(tokens, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(tokens)

    # --- loglikelihood

    def _forward_rows(self, rows: list[_Row]):
        """Yields (row, next_logp [T], argmax [T], last_logp [V]) for rows sorted longest first, batch by batch."""
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            T = length_bucket(len(batch[0].tokens), self.max_length, 2 * self.context)
            tokens_BT = np.zeros((self.batch_size, T), np.int32)
            lengths_B = np.ones((self.batch_size,), np.int32)
            for b, row in enumerate(batch):
                tokens_BT[b, : len(row.tokens)] = row.tokens
                lengths_B[b] = len(row.tokens)
            next_logp, argmax, last = _score(self.graphdef, self.params, self._place(tokens_BT), self._place(lengths_B),
                                             mesh=self.mesh)
            next_logp, argmax, last = (to_host(x) for x in (next_logp, argmax, last))
            for b, row in enumerate(batch):
                yield row, next_logp[b], argmax[b], last[b]

    def _place(self, array: np.ndarray):
        if self.mesh is None:
            return jnp.asarray(array)
        spec = sharding.logical_spec(("batch",) + (None,) * (array.ndim - 1), array.shape, self.mesh)
        return jax.device_put(array, NamedSharding(self.mesh, spec))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether each continuation token is the argmax) per
        ((context, continuation) strings or None, context tokens, continuation tokens), as HFLM computes them."""
        rows: dict[tuple[int, ...], _Row] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise ValueError(f"request {index}: the continuation has no tokens")
            if not context:
                raise ValueError(f"request {index}: the context has no tokens")
            if len(continuation) > self.max_length:
                raise ValueError(f"request {index}: the continuation ({len(continuation)} tokens) is longer than "
                                 f"max_length {self.max_length}")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            key = tuple(whole[:-1])  # requests sharing context + continuation[:-1] share the row
            rows.setdefault(key, _Row(key, [])).requests.append((index, len(continuation), int(whole[-1])))
        ordered = sorted(rows.values(), key=lambda row: (-len(row.tokens), row.tokens))
        results: list = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for row, next_logp, argmax, last in self._forward_rows(ordered):
            n = len(row.tokens)
            for index, count, final in row.requests:
                # positions n - count .. n - 2 predict tokens inside the row; position n - 1 predicts `final`
                span = slice(n - count, n - 1)
                logprob = float(next_logp[span].sum(dtype=np.float64) + last[final])
                greedy = bool((argmax[span] == np.asarray(row.tokens[n - count + 1 :], np.int32)).all()
                              and argmax[n - 1] == final)
                results[index] = (logprob, greedy)
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], results[index])
                progress.update(1)
        progress.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm_eval's disjoint rolling windows (HFLM's)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batched KV-cached generation per group of equal generation_kwargs, longest contexts first."""
        if self.context > 1:
            raise ValueError(f"generate_until: KV-cached decoding does not split the sequence, but the mesh has "
                             f"context={self.context}: run generation tasks on a mesh without a context axis")
        collator = Collator([req.args for req in requests], sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                            group_by="gen_kwargs", group_fn=lambda args: args[1])
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        results = []
        for batch_index, chunk in enumerate(collator.get_batched(n=self.batch_size)):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            if ignored := sorted(set(kwargs) - _SAMPLING_KEYS):
                log.warning("generation_kwargs %s are not used by the diffjax model (it takes do_sample, temperature, "
                            "top_k, top_p, until, max_gen_toks)", ignored)
            until = [s for s in kwargs["until"] if s]
            max_new = int(kwargs["max_gen_toks"])
            if not 0 < max_new < self.max_length:
                raise ValueError(f"max_gen_toks ({max_new}) must be positive and below max_length ({self.max_length})")
            from diffjax.generate.sampling import Sampling

            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            # only ids the tokenizer decodes (a padded vocabulary has more; a tiktoken vocabulary has gaps)
            decodable = dict(allowed_vocab_size=self.tokenizer.vocab_size, blocked_ids=self.tokenizer.undecodable_ids())
            sampling = Sampling(temperature, kwargs.get("top_k"), kwargs.get("top_p"), **decodable) if temperature \
                else Sampling(**decodable)
            prompts = [self.tok_encode(context, left_truncate_len=self.max_length - max_new) for context in contexts]
            key = jax.random.fold_in(jax.random.key(self.seed), batch_index)
            for context, new in zip(contexts, self._generate(prompts, max_new, sampling, until, key)):
                text = postprocess_generated_text(self.tok_decode(new), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                progress.update(1)
        progress.close()
        return collator.get_original(results)

    def _generate(self, prompts: list[list[int]], max_new: int, sampling, until: list[str], key) -> list[list[int]]:
        """Each prompt's new tokens, up to (not including) eos: diffjax.generate's prefill and decode steps,
        ended early once every row has produced eos or holds a stop string."""
        from diffjax.generate import decode

        if any(not prompt for prompt in prompts):
            prompts = [prompt or [self.prefix_token_id] for prompt in prompts]  # HF would feed an empty row its bos
        eos = self.tokenizer.eos_id
        P = length_bucket(max(map(len, prompts)), self.max_length - max_new)
        prompts_BP = np.zeros((self.batch_size, P), np.int32)
        lengths_B = np.ones((self.batch_size,), np.int32)
        for b, prompt in enumerate(prompts):
            prompts_BP[b, : len(prompt)] = prompt
            lengths_B[b] = len(prompt)
        choice = decode.Choice(sampling, () if eos is None else (int(eos),), 0 if eos is None else int(eos))
        rows = len(prompts)
        so_far = [[] for _ in range(rows)]

        def cut(new_rows: list[list[int]]) -> list[list[int]]:
            return [row[: row.index(eos)] if eos is not None and eos in row else row for row in new_rows]

        def on_tokens(step: int, tokens_B) -> bool:
            """False (stop) once every row has produced eos or holds a stop string."""
            for row, token in zip(so_far, tokens_B[:rows].tolist()):
                row.append(token)
            return not ((step + 1) % STOP_CHECK_EVERY == 0 and
                        all(len(row) <= step or any(s in self.tok_decode(row) for s in until) for row in cut(so_far)))

        decoded = decode.run(self.graphdef, self.params, self._place(prompts_BP), self._place(lengths_B), key,
                             max_len=P + max_new, max_new_tokens=max_new, choice=choice, mesh=self.mesh,
                             on_tokens=on_tokens)
        return cut([row[:decoded.steps] for row in decoded.tokens_BN[:rows].tolist()])
