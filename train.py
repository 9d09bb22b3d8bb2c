"""Train a tiny Differential Transformer on the Python standard library's source, byte by byte.

    python train.py                      # the default tiny DIFF model, a few minutes on 2 CPU cores
    python train.py --attention standard # the baseline with the same width (twice the heads)

Needs no download: the corpus is the stdlib's own `.py` files (diffjax.data.builtin_corpus).
"""

from __future__ import annotations

import argparse
import math
import time

from flax import nnx

from diffjax.config import ModelConfig
from diffjax.data import DEFAULT_CORPUS_BYTES, builtin_corpus, split_train_eval
from diffjax.model import TransformerLM
from diffjax.tokenizers import ByteTokenizer
from diffjax.train import OptimizerConfig, TrainConfig, make_optimizer, train

D_MODEL, NUM_LAYERS, DIFF_HEADS = 128, 4, 4
EVAL_FRACTION = 0.05


def model_config(attention: str, seq_len: int, vocab_size: int) -> ModelConfig:
    """The tiny default model. The baseline gets twice the heads of the same head_dim, as in the paper."""
    heads = DIFF_HEADS if attention == "diff" else 2 * DIFF_HEADS
    return ModelConfig(
        vocab_size=vocab_size, d_model=D_MODEL, num_layers=NUM_LAYERS, num_heads=heads,
        attention=attention, max_seq_len=seq_len,
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100, help="0: evaluate only at the end")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--attention", choices=("diff", "standard"), default="diff")
    parser.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode_bytes(builtin_corpus(args.corpus_bytes))
    train_tokens, eval_tokens = split_train_eval(tokens, EVAL_FRACTION)

    config = model_config(args.attention, args.seq_len, tokenizer.vocab_size)
    model = TransformerLM(config, rngs=nnx.Rngs(args.seed))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    tx, schedule = make_optimizer(OptimizerConfig(peak_lr=args.lr, warmup_steps=warmup, total_steps=args.steps))
    train_config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        log_every=args.log_every, eval_every=args.eval_every,
    )
    print(
        f"model: {config.attention} attention, d_model {config.d_model}, {config.num_layers} layers, "
        f"{config.num_heads} heads of dim {config.head_dim}, {model.num_params():,} params"
    )
    print(
        f"data: {len(train_tokens):,} train / {len(eval_tokens):,} eval bytes of stdlib source; "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, peak lr {args.lr:g}, warmup {warmup}"
    )
    start = time.perf_counter()
    summary = train(model, tx, schedule, train_tokens, eval_tokens, train_config)
    eval_text = f"{summary.eval_loss:.3f}" if summary.eval_loss is not None else "n/a"
    print(f"done in {time.perf_counter() - start:.1f}s, {summary.tokens_per_second:,.0f} tok/s")
    print(f"final train loss {summary.final_train_loss:.3f} (ln 256 = {math.log(256):.3f}), eval loss {eval_text}")


if __name__ == "__main__":
    main()
