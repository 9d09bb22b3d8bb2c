"""A model whose vocabulary is padded past its tokenizer's (sizes rounded up to 64 / 128) never emits an id the
tokenizer lacks: not in diffjax.generate (greedy or sampled), the generate CLI, lm-eval's generation, nor the
trainer's end-of-run sample."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.config import ModelConfig
from diffjax.generate.sampling import Sampling, next_tokens
from diffjax.model import TransformerLM
from diffjax.tokenizers import ByteTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
BYTES = ByteTokenizer.vocab_size  # 257 ids the tokenizer decodes
PADDED = 384  # the model's: 257 rounded up to a multiple of 128
TINY = ModelConfig(vocab_size=PADDED, d_model=32, num_layers=1, num_heads=2, max_seq_len=32)


def padded_model(favoured: int = 300) -> TransformerLM:
    """A model whose every logit is 0 but two padded ids': the final norm keeps one dimension, which the head maps to
    +100 for `favoured` and -100 for favoured + 1. Whatever that dimension's sign, a padded id is the argmax, and at
    temperature 1 it takes nearly all the probability."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(TINY, rngs=nnx.Rngs(0))))
    rng = np.random.RandomState(0)
    params = jax.tree.map(lambda x: (0.2 * rng.standard_normal(x.shape)).astype(x.dtype), nnx.to_pure_dict(state))
    params["final_norm"]["scale"] = np.eye(TINY.d_model, dtype=np.float32)[0]
    head_DV = np.zeros((TINY.d_model, PADDED), np.float32)
    head_DV[0, favoured], head_DV[0, favoured + 1] = 100.0, -100.0
    params["lm_head"] = head_DV
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0), Sampling(1.0, top_k=5), Sampling(2.0, top_p=0.9)],
                         ids=["greedy", "sampled", "top_k", "top_p"])
def test_next_tokens_never_choose_a_masked_id(sampling):
    """The padded ids hold the highest logits by far: every rule still picks below allowed_vocab_size."""
    logits_BV = jax.random.normal(jax.random.key(1), (64, PADDED)).at[:, BYTES:].add(50.0)
    masked = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, allowed_vocab_size=BYTES)
    tokens_B = np.asarray(next_tokens(logits_BV, jax.random.key(2), masked))
    assert tokens_B.max() < BYTES
    # without the mask, the same rule picks the padded ids (what the mask is for)
    assert np.asarray(next_tokens(logits_BV, jax.random.key(2), sampling)).min() >= BYTES
    if sampling.greedy:  # greedy among the allowed ids is their argmax
        np.testing.assert_array_equal(tokens_B, np.argmax(np.asarray(logits_BV)[:, :BYTES], axis=-1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_keeps_to_the_allowed_ids(temperature):
    model = padded_model()
    options = dict(temperature=temperature, key=jax.random.key(0))
    unmasked = diffjax.generate(model, [[104, 105], [1]], 6, **options)
    assert (unmasked >= BYTES).all()  # the model's choice, left alone
    new = diffjax.generate(model, [[104, 105], [1]], 6, allowed_vocab_size=BYTES, **options)
    assert new.max() < BYTES
    ByteTokenizer().decode(new[0])


def test_allowed_vocab_size_is_checked():
    with pytest.raises(ValueError, match="allowed_vocab_size must be a positive integer or None, got 0"):
        diffjax.generate(padded_model(), [[1]], 2, allowed_vocab_size=0)


def test_the_generate_cli_decodes_a_padded_models_text(tmp_path, capsys):
    from diffjax.checkpoint import save_params
    from diffjax.generate.__main__ import main

    run_dir = tmp_path / "run"
    save_params(run_dir, nnx.to_pure_dict(nnx.state(padded_model(), nnx.Param)), TINY)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("data:\n", "data:\n  tokenizer: {kind: byte}\n"))
    for temperature in ("0", "1"):
        assert main(["--checkpoint", str(run_dir), "--prompt", "hi", "--max-new-tokens", "5",
                     "--temperature", temperature]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("hi")


@pytest.mark.parametrize("gen_kwargs", [{"until": ["\n\n"]}, {"until": ["\n\n"], "do_sample": True, "temperature": 1.0}],
                         ids=["greedy", "sampled"])
def test_lm_eval_generation_keeps_to_the_tokenizers_ids(gen_kwargs):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from diffjax.eval import DiffjaxLM

    lm = DiffjaxLM(model=padded_model(), tokenizer="byte", batch_size=2, max_length=32, max_gen_toks=6)
    requests = [Instance("generate_until", {}, (context, gen_kwargs), 0) for context in ("the cat", "a")]
    assert [isinstance(text, str) for text in lm.generate_until(requests, disable_tqdm=True)] == [True, True]


@pytest.mark.slow
def test_train_py_samples_a_padded_vocabulary_through_the_end_of_run_sample(tmp_path):
    """model.vocab_size 384 over the byte tokenizer's 257: a few steps leave the distribution near uniform, so an
    unmasked sample of 48 tokens at temperature 1 all but surely holds a padded id (which the byte tokenizer cannot
    decode)."""
    result = subprocess.run(
        [sys.executable, "train.py", f"model.vocab_size={PADDED}", "model.d_model=32", "model.num_layers=1",
         "model.num_heads=2", "model.max_seq_len=64", "data.seq_len=32", "data.builtin_bytes=100000",
         "data.shuffle_window_tokens=4096", "data.eval_fraction=0", "train.steps=2", "train.batch_size=2",
         "train.sample_tokens=48", "train.sample_temperature=1.0", "train.progress=lines", "optim.warmup_steps=0",
         "parallel.data=1", f"train.run_dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sample (temperature" in result.stdout


def test_a_tokenizers_gaps_are_never_generated():
    """tiktoken vocabularies have gaps below n_vocab (cl100k_base: 100256, 100261-100275) that decode() refuses:
    generation blocks them, as the trainer's sample, the generate CLI and lm-eval pass undecodable_ids()."""
    import tiktoken

    from diffjax.tokenizers import TiktokenTokenizer

    ranks = {bytes([b]): b for b in range(256)}
    encoding = tiktoken.Encoding(name="gappy", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 300})  # ids 256..299 name nothing
    tokenizer = TiktokenTokenizer(encoding)
    assert tokenizer.vocab_size == 301 and tokenizer.undecodable_ids() == tuple(range(256, 300))
    assert ByteTokenizer().undecodable_ids() == ()
    with pytest.raises(ValueError, match="is not in"):
        tokenizer.decode([280])  # what an unblocked sample would have hit
    logits_BV = jax.random.normal(jax.random.key(1), (64, PADDED)).at[:, 256:300].add(50.0)
    for sampling in [Sampling(allowed_vocab_size=301, blocked_ids=tokenizer.undecodable_ids()),
                     Sampling(1.0, top_k=5, allowed_vocab_size=301, blocked_ids=tokenizer.undecodable_ids())]:
        tokens_B = np.asarray(next_tokens(logits_BV, jax.random.key(2), sampling))
        assert not np.isin(tokens_B, range(256, 300)).any() and tokens_B.max() < 301
        tokenizer.decode(tokens_B)
    new = diffjax.generate(padded_model(favoured=280), [[104, 105]], 4, allowed_vocab_size=301,
                           blocked_ids=tokenizer.undecodable_ids())
    assert not np.isin(new, range(256, 300)).any()
    tokenizer.decode(new[0])
