"""Generation speed against transformers, on the same converted model, with the memory-bandwidth limit beside it.

    python benchmarks/generate.py                       # the issue-33 grid on a random 56M DiffLlama (made here)
    python benchmarks/generate.py --hf DIR --batches 1,8 --prompts 64 --dtypes bfloat16 --peers eager,compiled
    python benchmarks/generate.py --model 1.4b --dtypes bfloat16 --batches 1,8 --prompts 64   # on a GPU

The model: a transformers DiffLlama / Llama directory (--hf), or by default a random DiffLlama of 56M parameters
(d_model 512, 8 layers, 8 heads / 4 KV heads, vocab 32000, MLP 1376; --model 1.4b: the paper's 1.4B shape, for a
GPU) that transformers creates and saves. diffjax
loads it with diffjax.load_hf in each dtype; transformers runs the same weights. For each dtype, prompt length
and batch: random prompts, greedy, --new-tokens new tokens (no stop token, so every run makes all of them),
the median of --repeats timed runs after a warm-up run (diffjax's warm-up compiles).

Figures per row, for diffjax and each peer (transformers `generate`: "eager" with its dynamic KV cache;
"compiled": its static cache with the forward under torch.compile):
  tokens_per_s   batch x new tokens / the whole generate call (prefill included), as a user sees it;
  step_ms        one decode step: (the call with N new tokens - the call with 1) / (N - 1);
  and for diffjax, bytes_per_step (every weight read once in the compute dtype, the embedding table only for the
  looked-up rows, plus the KV cache filled so far, on average over the decode) over step_ms: the bandwidth the decode
  reaches, as a fraction of the copy bandwidth measured in the same run (a jitted in-place y = 2x over 256 MiB, bytes
  read + written per second: what the machine's memory sustains for a streaming kernel).
Ratios are diffjax / peer tokens/s. Writes benchmarks/results/generate_<platform>.json.

    python benchmarks/generate.py --cache-sizes motif3/published,motif3/small

--cache-sizes runs nothing: for each run config (a GDLA model) it takes the KV cache's buffers' shapes (jax.eval_shape
of a prefill: no memory used) and prints bytes of cache per token and per sequence at 4K, 32K and 256K tokens for
the cache generation keeps (the kv latent and the RoPE key, windowed layers in rings), the latent without rings, and
the expanded-head cache GDLA kept before (every kv head's keys and values, every slot), then writes the table to
benchmarks/results/cache_sizes.md (--out).

    python benchmarks/generate.py --speculative

--speculative: self-speculative decoding (diffjax.generate(..., draft="mtp")) beside plain greedy decoding on a small
DIFF model with --mtp-depths MTP depths, trained here for --train-steps steps with the MTP loss on a synthetic
low-entropy source (a random Markov chain: each token's successor fixed with probability 0.9), so that the drafts
are sometimes right; for --batches (default 1,8): tokens/s of each (batch x new tokens / the call, prefill included,
median of --repeats after a compiling run), the ratio, the acceptance rate (accepted / drafted drafts) and whether
the tokens equal plain greedy's. Writes benchmarks/results/speculative_<platform>.md (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as py_platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import diffjax  # noqa: E402

MODELS = {  # random DiffLlamas that transformers makes and saves (--model)
    "56m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                intermediate_size=1376, max_position_embeddings=2048),
    # the paper's 1.4B DIFF Transformer (configs/paper/diff-1.4b.yaml: 8 differential heads of 2 x 128, MLP 8/3 d
    # rounded to 64, the 100,288 vocabulary): 1.6B parameters with the untied head
    "1.4b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                 vocab_size=100288, intermediate_size=5440, max_position_embeddings=4096),
}


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(repeats: int = 10) -> float:
    """Bytes read + written per second by y = 2x over 256 MiB of float32 (1 GiB on an accelerator, where 256 MiB
    takes ~0.1 ms), in place (the input donated: a fresh output buffer each call would time the page faults of
    allocating it)."""
    double = jax.jit(lambda x: x * 2, donate_argnums=0)
    mib = 256 if jax.default_backend() == "cpu" else 1024
    x = double(jnp.ones((mib * 2**18,), jnp.float32)).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x = double(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


def bytes_per_step(model, batch: int, cache_slots: float) -> float:
    """Bytes one decode step must read: every weight once (the embedding table only for the rows it looks up)
    in the compute dtype, plus `cache_slots` keys and values per row and layer (their size from a prefill's cache)."""
    from flax import nnx

    from diffjax.model.kv_cache import KVCache

    config, itemsize = model.config, jnp.dtype(model.config.dtype).itemsize
    weights = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not config.tie_embeddings:  # the table is gathered, not read (tied: it is the head, read whole)
        weights -= config.vocab_size * config.d_model - batch * config.d_model
    _, cache = jax.eval_shape(lambda: model(jnp.zeros((1, 1), jnp.int32), cache=KVCache.empty(1, 1),
                                            layer_params=model.unstacked_blocks()))
    cache_bytes_per_slot = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))  # all layers
    return itemsize * weights + batch * cache_slots * cache_bytes_per_slot


CONTEXTS = (4096, 32768, 262144)


def layer_cache_bytes(config, context: int, layout: str) -> list[int]:
    """Bytes of one sequence's cache per layer at `context` positions, from the real buffers' shapes (eval_shape).
    layout "latent": what generation keeps (layers in a loop: windowed layers in rings); "latent_no_ring": the same
    buffers through the scanned stack (every layer `context` slots); "expanded": the generic KVCache holding GDLA's
    expanded heads (expanded_kv: k [Hkv, d] and v [Hkv, dv] per token), every layer `context` slots."""
    from flax import nnx

    from diffjax.model import TransformerLM
    from diffjax.model.attention.gdla import GroupedDiffLatentAttention
    from diffjax.model.kv_cache import KVCache

    dtype = jnp.dtype(config.dtype)
    if layout == "expanded":
        o = config.attention_options
        graphdef, state = nnx.split(nnx.eval_shape(lambda: GroupedDiffLatentAttention(config, rngs=nnx.Rngs(0))))

        def expanded_cache(state):
            latent, k_rope = jnp.zeros((1, 1, o.kv_lora_rank), dtype), jnp.zeros((1, 1, o.qk_rope_head_dim), dtype)
            k, v = nnx.merge(graphdef, state).expanded_kv(latent, k_rope)
            return KVCache.empty(1, context).update(k, v, {})[0]

        cache = jax.eval_shape(expanded_cache, state)
        return [cache.k.size * cache.k.dtype.itemsize + cache.v.size * cache.v.dtype.itemsize] * config.num_layers
    config = config.replace(scan_layers=layout == "latent_no_ring")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))

    def prefilled(state):
        model = nnx.merge(graphdef, state)
        layer_params = None if config.scan_layers else model.unstacked_blocks()
        return model(jnp.zeros((1, 1), jnp.int32), cache=KVCache.empty(1, context), layer_params=layer_params)[1]

    cache = jax.eval_shape(prefilled, state)
    if config.scan_layers:  # stacked [L, ...] buffers
        return [sum(x.size // x.shape[0] * x.dtype.itemsize for x in (cache.k, cache.v))] * config.num_layers
    return [k.size * k.dtype.itemsize + v.size * v.dtype.itemsize for k, v in zip(cache.k, cache.v)]


def cache_size_rows(name: str, config) -> list[dict]:
    """One row per layout: bytes per token and layer (a global layer), per token over all layers (without rings),
    and per sequence at CONTEXTS positions."""
    rows, contexts = [], sorted({context for context in CONTEXTS if context <= config.max_seq_len} | {config.max_seq_len})
    measured = {(layout, context): layer_cache_bytes(config, context, layout)
                for layout in ("expanded", "latent_no_ring", "latent") for context in contexts}
    for layout in ("expanded", "latent_no_ring", "latent"):
        per_context = {context: measured[layout, context] for context in contexts}
        largest = max(contexts)  # per token: the layers that keep every position (no rings)
        per_token = [b / largest for b in measured["latent_no_ring" if layout == "latent" else layout, largest]]
        rows.append({"config": name, "layout": layout, "dtype": config.dtype, "layers": config.num_layers,
                     "max_seq_len": config.max_seq_len,
                     "bytes_per_token_per_layer": per_token[0], "bytes_per_token": sum(per_token),
                     "bytes_per_sequence": {str(c): sum(b) for c, b in per_context.items()}})
    return rows


LAYOUT_LABELS = {"expanded": "expanded heads (before)", "latent_no_ring": "latent, no rings",
                 "latent": "latent + rings (generate)"}


def cache_size_table(rows: list[dict]) -> str:
    def size(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    lines = ["| config | cache | dtype | bytes / token / layer | bytes / token (all layers) | "
             + " | ".join(f"per sequence at {c // 1024}K" for c in CONTEXTS) + " | at max_seq_len |",
             "|---|---|---|---|---|" + "---|" * (len(CONTEXTS) + 1)]
    for row in rows:
        sequences = " | ".join(size(row["bytes_per_sequence"][str(c)]) if str(c) in row["bytes_per_sequence"] else "-"
                               for c in CONTEXTS + (row["max_seq_len"],))
        lines.append(f"| {row['config']} | {LAYOUT_LABELS[row['layout']]} | {row['dtype']} | "
                     f"{row['bytes_per_token_per_layer']:,.0f} | {row['bytes_per_token']:,.0f} | {sequences} "
                     f"({row['max_seq_len']:,}) |")
    return "\n".join(lines)


def cache_sizes(paths: list[str], out: Path) -> list[dict]:
    """--cache-sizes: the table for each run config, printed and written to `out`."""
    from diffjax.train.config import load_run_config

    rows = []
    for path in paths:
        config = load_run_config(path).model
        if config.attention != "gdla":
            raise SystemExit(f"--cache-sizes: {path} has attention={config.attention!r}; the latent cache is GDLA's")
        rows += cache_size_rows(Path(path).stem, config)
    table = cache_size_table(rows)
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# KV cache bytes (`python benchmarks/generate.py --cache-sizes {','.join(paths)}`)\n\n"
                   "From the cache buffers' shapes (jax.eval_shape of a prefill), one sequence. \"bytes / token\": "
                   "a layer that keeps every position; windowed layers keep rings of their window (generate).\n\n"
                   f"{table}\n")
    print(f"wrote {out}")
    return rows


def time_diffjax(model, prompts_BP: np.ndarray, new_tokens: int, repeats: int) -> dict:
    def run(n):
        return diffjax.generate(model, prompts_BP, n)

    run(new_tokens), run(1)  # compiles both
    full_s, one_s = median_seconds(lambda: run(new_tokens), repeats), median_seconds(lambda: run(1), repeats)
    return {"tokens_per_s": prompts_BP.shape[0] * new_tokens / full_s, "seconds": full_s,
            "step_ms": 1e3 * (full_s - one_s) / (new_tokens - 1)}


class TransformersPeer:
    """transformers' generate on the same weights, on `device` (a torch device): "eager" (its dynamic cache) or
    "compiled" (a static cache; on CUDA, generate compiles the forward itself, with CUDA graphs, as users get it;
    elsewhere generate compiles nothing, so the forward is wrapped in torch.compile here)."""

    def __init__(self, hf_dir: Path, dtype: str, mode: str, device: str):
        import torch
        import transformers

        self.torch, self.mode, self.device = torch, mode, device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
        if mode == "compiled":
            # One compile per (batch, cache length) and the prefill's: more shapes than dynamo's default limit of 8,
            # past which it would silently run the rest eagerly.
            torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 256
            if not device.startswith("cuda"):
                self.model.forward = torch.compile(self.model.forward, dynamic=False)

    def generate(self, prompts_BP: np.ndarray, new_tokens: int, cache_len: int | None = None):
        """Greedy tokens [B, new_tokens]. `cache_len` sizes the static cache (default prompt + new tokens): timing
        1 token with the full run's cache length keeps the compiled shapes, so it measures no recompilation."""
        torch = self.torch
        ids = torch.tensor(prompts_BP, dtype=torch.long, device=self.device)
        options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
        if self.mode == "compiled":
            from transformers import StaticCache

            options["past_key_values"] = StaticCache(config=self.model.config,
                                                     max_cache_len=cache_len or prompts_BP.shape[1] + new_tokens)
        with torch.no_grad():
            out = self.model.generate(ids, **options)
        return out[:, prompts_BP.shape[1]:].cpu().numpy()

    def time(self, prompts_BP: np.ndarray, new_tokens: int, repeats: int) -> dict:
        cache_len = prompts_BP.shape[1] + new_tokens
        self.generate(prompts_BP, new_tokens), self.generate(prompts_BP, 1, cache_len)  # warm-up (compiles)
        full_s = median_seconds(lambda: self.generate(prompts_BP, new_tokens), repeats)
        one_s = median_seconds(lambda: self.generate(prompts_BP, 1, cache_len), repeats)
        return {"tokens_per_s": prompts_BP.shape[0] * new_tokens / full_s, "seconds": full_s,
                "step_ms": 1e3 * (full_s - one_s) / (new_tokens - 1)}


def make_model(size: str, directory: Path, device: str) -> Path:
    """A random DiffLlama of MODELS[size], initialised on `device` (fast for 1.4B on a GPU) and saved in float32
    (1.4b: bfloat16, half the bytes to write and read back)."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**MODELS[size]))
    if size == "1.4b":
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def markov_tokens(successor: np.ndarray, rows: int, length: int, seed: int) -> np.ndarray:
    """[rows, length] tokens of the chain: each token's successor[token] with probability 0.9, else a random one."""
    draws = np.random.RandomState(seed)
    tokens = np.zeros((rows, length), np.int32)
    tokens[:, 0] = draws.randint(0, successor.size, rows)
    for t in range(1, length):
        keep = draws.rand(rows) < 0.9
        tokens[:, t] = np.where(keep, successor[tokens[:, t - 1]], draws.randint(0, successor.size, rows))
    return tokens


def trained_mtp_model(depths: int, steps: int):
    """A small DIFF model with `depths` MTP depths trained `steps` steps (adam 3e-3, 16 x 128 tokens) on the chain."""
    import optax
    from flax import nnx

    from diffjax.config import ModelConfig
    from diffjax.model import TransformerLM
    from diffjax.train.step import init_state, make_train_step

    config = ModelConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=4, max_seq_len=512, attention="diff",
                         mtp_depths=depths)
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    successor = np.random.RandomState(1).permutation(config.vocab_size)
    tx = optax.adam(3e-3)
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, optax.constant_schedule(3e-3), config), donate_argnums=0)
    state = init_state(model, tx, jax.random.key(0))
    for i in range(steps):
        tokens = markov_tokens(successor, 16, 128, seed=i)[None]
        state, metrics = step(state, {"tokens": tokens, "positions": np.broadcast_to(np.arange(128), tokens.shape),
                                      "segment_ids": np.ones_like(tokens)})
    print(f"trained {steps} steps: loss {float(metrics['loss']):.3f}", flush=True)
    nnx.update(model, state["params"])
    return model, successor


def speculative(args) -> None:
    """--speculative: plain against speculative greedy decoding, per batch (module docstring)."""
    device = jax.devices()[0]
    model, successor = trained_mtp_model(args.mtp_depths, args.train_steps)
    prompt_len = int(args.prompts.split(",")[0]) if args.prompts != "64,512" else 32
    lines = ["| batch | plain tok/s | speculative tok/s | speculative / plain | acceptance | verify steps | "
             "tokens equal |", "|---|---|---|---|---|---|---|"]
    for batch in (int(b) for b in args.batches.split(",")):
        prompts_BP = markov_tokens(successor, batch, prompt_len, seed=10_000 + batch)
        acceptance = []
        plain = diffjax.generate(model, prompts_BP, args.new_tokens)
        ours = diffjax.generate(model, prompts_BP, args.new_tokens, draft="mtp", acceptance=acceptance)
        plain_s = median_seconds(lambda: diffjax.generate(model, prompts_BP, args.new_tokens), args.repeats)
        ours_s = median_seconds(lambda: diffjax.generate(model, prompts_BP, args.new_tokens, draft="mtp"), args.repeats)
        tokens = batch * args.new_tokens
        lines.append(f"| {batch} | {tokens / plain_s:.1f} | {tokens / ours_s:.1f} | **{plain_s / ours_s:.2f}x** | "
                     f"{acceptance[0].rate:.2f} | {acceptance[0].steps} | {bool((plain == ours).all())} |")
        print(lines[-1], flush=True)
    command = " ".join(["python benchmarks/generate.py"] + sys.argv[1:])
    out = args.out or Path(__file__).resolve().parent / "results" / f"speculative_{device.platform}.md"
    out.write_text(
        f"# Self-speculative decoding (MTP drafts) against plain greedy decoding\n\n`{command}` on "
        f"{datetime.date.today().isoformat()}: {device.platform} ({device.device_kind}, {os.cpu_count()} cores), jax "
        f"{jax.__version__}. A DIFF model (d_model 128, 4 layers, vocab 256) with {args.mtp_depths} MTP depth(s), "
        f"trained {args.train_steps} steps with the MTP loss on a random Markov chain (successor fixed with p 0.9); "
        f"prompts of {prompt_len} tokens from the chain, {args.new_tokens} new tokens, greedy, no stop token; tokens/s "
        f"= batch x new tokens / the call (prefill included), median of {args.repeats}. Acceptance: accepted / drafted "
        f"drafts (K per verify step and row).\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", type=Path, help="a transformers model directory (default: make a random DiffLlama, --model)")
    parser.add_argument("--model", choices=sorted(MODELS), default="56m", help="the random DiffLlama's size (without --hf)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", default="64,512", help="prompt lengths (default 64,512)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--peers", default="eager,compiled", help="transformers modes to run beside diffjax: eager, "
                        "compiled, or none")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is reported")
    parser.add_argument("--check-tokens", action="store_true", help="also require diffjax's greedy tokens to equal "
                        "the eager peer's (float32 rows)")
    parser.add_argument("--torch-device", default=None, help="where transformers runs (default: cuda when JAX runs on "
                        "a GPU and torch sees one, else cpu)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--speculative", action="store_true", help="self-speculative decoding beside plain greedy on "
                        "a small model trained here with the MTP loss (module docstring)")
    parser.add_argument("--mtp-depths", type=int, default=2, help="--speculative: the model's MTP depths (default 2)")
    parser.add_argument("--train-steps", type=int, default=300, help="--speculative: training steps (default 300)")
    parser.add_argument("--cache-sizes", help="comma-separated GDLA run configs (shipped names or files): only print and write the KV cache's "
                        "bytes per token, latent beside expanded heads (benchmarks/results/cache_sizes.md)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.speculative:
        return speculative(args)
    if args.cache_sizes:
        cache_sizes(args.cache_sizes.split(","), args.out or Path(__file__).resolve().parent / "results" / "cache_sizes.md")
        return
    peers = [] if args.peers == "none" else args.peers.split(",")
    device = jax.devices()[0]
    torch_device = args.torch_device or "cpu"
    if peers or not args.hf:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        if args.torch_device is None and device.platform == "gpu" and torch.cuda.is_available():
            torch_device = "cuda"
    workdir = tempfile.TemporaryDirectory()
    hf_dir = args.hf or make_model(args.model, Path(workdir.name) / "model", torch_device)
    copy_bytes_per_s = copy_bandwidth()
    print(f"{device.platform} ({device.device_kind}), jax {jax.__version__}; copy bandwidth {copy_bytes_per_s / 1e9:.1f} GB/s "
          f"(read + written); {hf_dir}", flush=True)
    out = args.out or Path(__file__).resolve().parent / "results" / f"generate_{device.platform}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, broken = [], {}

    def write():  # after every row: a long grid stopped midway keeps what it measured
        out.write_text(json.dumps({
            "device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "python": py_platform.python_version(), "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "model": str(args.hf or MODELS[args.model]), "torch_device": torch_device, "copy_bytes_per_s": copy_bytes_per_s, "peers_that_failed": broken,
            "rows": rows}, indent=1))

    for dtype in args.dtypes.split(","):
        model = diffjax.load_hf(hf_dir, dtype=dtype)
        peer_models = {}
        for mode in peers:
            try:
                peer_models[mode] = TransformersPeer(hf_dir, dtype, mode, torch_device)
            except Exception as error:  # noqa: BLE001 (a peer that cannot run here is reported, not fatal)
                broken[mode] = f"{type(error).__name__}: {error}"
        for prompt_len in (int(p) for p in args.prompts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                prompts_BP = np.random.RandomState(batch + prompt_len).randint(0, model.config.vocab_size, (batch, prompt_len))
                row = {"dtype": dtype, "batch": batch, "prompt_len": prompt_len, "new_tokens": args.new_tokens,
                       "diffjax": time_diffjax(model, prompts_BP, args.new_tokens, args.repeats)}
                step_bytes = bytes_per_step(model, batch, prompt_len + args.new_tokens / 2)
                row["diffjax"]["bytes_per_step"] = step_bytes
                row["diffjax"]["fraction_of_copy_bandwidth"] = step_bytes / (row["diffjax"]["step_ms"] / 1e3) / copy_bytes_per_s
                rows.append(row)
                write()
                for mode, peer in peer_models.items():
                    if mode in broken:
                        continue
                    try:
                        row[mode] = peer.time(prompts_BP, args.new_tokens, args.repeats)
                        row[mode]["ratio"] = row["diffjax"]["tokens_per_s"] / row[mode]["tokens_per_s"]
                        write()
                    except Exception as error:  # noqa: BLE001
                        broken[mode] = f"{type(error).__name__}: {error}"
                        traceback.print_exc()
                if args.check_tokens and dtype == "float32" and "eager" in peer_models:
                    ours, theirs = diffjax.generate(model, prompts_BP, args.new_tokens), peer_models["eager"].generate(prompts_BP, args.new_tokens)
                    row["tokens_equal_eager"] = float((ours == theirs).mean())
                write()
                print(format_row(row), flush=True)
    for mode, error in broken.items():
        print(f"transformers {mode}: could not run here: {error}")
    write()
    print(markdown_table(rows))
    print(f"wrote {out}")


def markdown_table(rows: list[dict]) -> str:
    """The rows as README's table: tokens/s of each, diffjax / transformers ratios, decode step, bandwidth fraction."""
    lines = ["| dtype | prompt | batch | diffjax tok/s | transformers eager | compiled (static cache) | diffjax step ms "
             "| of copy bandwidth |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours = row["diffjax"]
        peers = [f"{row[m]['tokens_per_s']:.1f} (**{row[m]['ratio']:.2f}x**)" if m in row else "-" for m in ("eager", "compiled")]
        lines.append(f"| {row['dtype']} | {row['prompt_len']} | {row['batch']} | {ours['tokens_per_s']:.1f} | {peers[0]} | "
                     f"{peers[1]} | {ours['step_ms']:.1f} | {ours['fraction_of_copy_bandwidth']:.0%} |")
    return "\n".join(lines)


def format_row(row: dict) -> str:
    ours = row["diffjax"]
    line = (f"{row['dtype']:>8} prompt {row['prompt_len']:>4} batch {row['batch']:>3}: diffjax {ours['tokens_per_s']:8.1f} tok/s "
            f"(step {ours['step_ms']:6.2f} ms, {ours['fraction_of_copy_bandwidth']:.0%} of copy bandwidth)")
    for mode in ("eager", "compiled"):
        if mode in row:
            line += f" | {mode} {row[mode]['tokens_per_s']:8.1f} tok/s (step {row[mode]['step_ms']:6.2f} ms) x{row[mode]['ratio']:.2f}"
    if "tokens_equal_eager" in row:
        line += f" | tokens equal {row['tokens_equal_eager']:.0%}"
    return line


if __name__ == "__main__":
    main()
