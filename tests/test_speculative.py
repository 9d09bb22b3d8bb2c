"""Self-speculative decoding with the MTP depths as drafter (diffjax.generate.speculative): the same tokens as plain
greedy decoding (diffjax.generate.decode), token for token, over rows of different prompt lengths, max_new_tokens and a
stop token, on a DIFF model (full and windowed layers: the rings' W + K slots) and a Motif 3-like one (GDLA's latent
cache, windowed and global layers, MoE, mHC); the acceptance counts on models built to draft right or wrong; the
refusals."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

PROMPTS = [[5, 9, 2, 7, 7, 1, 3], [11], [4, 8, 15, 16]]  # different lengths: right-padded rows


def _diff_model(depths: int, window: int | None = None, seed: int = 0, layers: int = 2) -> TransformerLM:
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=layers, num_heads=2, max_seq_len=64, attention="diff",
                         mtp_depths=depths, attention_window=window, global_layers=(1,) if window else ())
    return TransformerLM(config, rngs=nnx.Rngs(seed))


def _same_as_greedy(model, prompts, max_new_tokens, **options):
    """Speculative tokens against plain greedy ones (which run the same checks); the acceptance counts."""
    plain = diffjax.generate(model, prompts, max_new_tokens, **options)
    acceptance = []
    speculative = diffjax.generate(model, prompts, max_new_tokens, draft="mtp", acceptance=acceptance, **options)
    np.testing.assert_array_equal(speculative, plain)
    return plain, acceptance[0]


@pytest.mark.slow
@pytest.mark.parametrize("depths,window", [(1, None), pytest.param(2, 3, marks=pytest.mark.single_leg)])
def test_speculative_tokens_are_greedy_tokens_on_a_diff_model(depths, window):
    model = _diff_model(depths, window)
    plain, acceptance = _same_as_greedy(model, PROMPTS, 12)
    assert 0 <= acceptance.accepted <= acceptance.drafted and acceptance.drafted % depths == 0
    _same_as_greedy(model, PROMPTS[:1], 9)  # batch 1
    _same_as_greedy(model, PROMPTS, 1)  # the prefill's token only
    # a stop token the rows reach at different steps: the rest of each row is pad_id, as plain decoding's
    stop = int(plain[2, 4])
    stopped, _ = _same_as_greedy(model, PROMPTS, 12, stop_tokens=[stop], pad_id=63)
    assert (stopped == 63).any() and (stopped == stop).any()


@pytest.mark.slow
@pytest.mark.parametrize("depths", [1, pytest.param(2, marks=pytest.mark.single_leg)])
def test_speculative_tokens_are_greedy_tokens_on_a_motif3_like_model(depths):
    """GDLA (absorbed decode over the latent cache, several tokens per step), windowed layers with global ones (the
    windowed layers' rings, the MTP layer's window), MoE, mHC; prompts longer than the window."""
    from diffjax.convert.hf import config_from_hf
    from motif3_published import small_config

    config = config_from_hf({"model_type": "Motif", **small_config(num_nextn_predict_layers=depths)})
    assert config.attention_window < 11 and config.mlp == "moe" and config.residual == "mhc" and config.global_layers
    model = TransformerLM(config, rngs=nnx.Rngs(depths))
    prompts = [list(np.random.RandomState(0).randint(0, config.vocab_size, n)) for n in (11, 3, 7)]
    plain, _ = _same_as_greedy(model, prompts, 16)
    if depths == 1:  # (a compile each: one stop-token case, on every leg)
        _same_as_greedy(model, prompts, 16, stop_tokens=[int(plain[1, 5])])


def _drafting(model: TransformerLM, sign: float) -> TransformerLM:
    """The model with every layer adding nothing (attention and MLP outputs 0): its next token is f(this token) =
    argmax(final_norm(embedding) @ head). Each MTP depth passes on only the normed embedding of the token it reads
    (input_proj = [0; sign I]): +1 drafts f(that token), the model's own next token (every draft accepted); -1 the
    argmin of the same logits (none accepted)."""
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for stack in ("blocks", "blocks_mtp"):
        state[stack]["attn"]["o_kernel"] = jnp.zeros_like(state[stack]["attn"]["o_kernel"])
        state[stack]["mlp"]["down_kernel"] = jnp.zeros_like(state[stack]["mlp"]["down_kernel"])
    K, twoD, D = state["blocks_mtp"]["input_proj_kernel"].shape
    proj = jnp.concatenate([jnp.zeros((D, D)), sign * jnp.eye(D)])
    state["blocks_mtp"]["input_proj_kernel"] = jnp.broadcast_to(proj, (K, twoD, D))
    nnx.replace_by_pure_dict(params := nnx.state(model, nnx.Param), state)
    nnx.update(model, params)
    return model


@pytest.mark.parametrize("sign,rate", [(1.0, 1.0), (-1.0, 0.0)])
def test_acceptance_counts_drafts_the_model_keeps(sign, rate):
    model = _drafting(_diff_model(2, seed=1, layers=1), sign)
    _, acceptance = _same_as_greedy(model, PROMPTS, 13)
    assert acceptance.rate == rate
    # 12 tokens after the prefill's: 4 steps of 3 (all kept) or 12 steps of 1; 2 drafts a step for each of the rows
    assert acceptance.steps == (4 if rate else 12) and acceptance.drafted == 2 * 3 * acceptance.steps


def test_the_speculative_step_shares_the_loops_prefill_and_its_last_position_head():
    """MTPDraft is a step of the one decode loop: its program takes the LM head at each row's last prompt position
    only, [B, V], never at every prompt position, [B, P, V] (as its own prefill once did)."""
    from diffjax.generate import decode
    from diffjax.generate.sampling import Sampling
    from diffjax.generate.speculative import MTPDraft

    config = ModelConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=2, max_seq_len=64, mtp_depths=1)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))  # (shapes only)
    B, P, N = 3, 7, 5
    text = decode._generate.lower(graphdef, nnx.to_pure_dict(state), np.ones((B, P), np.int32), np.full((B,), P, np.int32),
                                  jax.random.key(0), np.int32(0), max_len=P + N, max_new_tokens=N,
                                  choice=decode.Choice(Sampling(), (), 0), mesh=None, streaming=False,
                                  step=MTPDraft(1)).as_text()
    assert f"tensor<{B}x{P}x61xf32>" not in text and f"tensor<{B}x61xf32>" in text


@pytest.mark.parametrize("model_changes,options,message", [
    ({}, {"temperature": 0.7, "key": jax.random.key(0)}, r"draft='mtp' decodes greedily: temperature must be 0, got 0.7"),
    ({"mtp_depths": 0}, {}, r"draft='mtp' needs a model with MTP depths \(ModelConfig.mtp_depths is 0\)"),
    ({}, {"draft": "ngram"}, r"draft must be None or 'mtp' .*got 'ngram'"),
    ({}, {"on_tokens": lambda step, tokens: None}, r"draft='mtp' does not stream: pass no on_tokens"),
])
def test_speculative_refusals_are_one_line(model_changes, options, message):
    config = ModelConfig(**{"vocab_size": 64, "d_model": 32, "num_layers": 1, "num_heads": 2, "mtp_depths": 1,
                            **model_changes})
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message) as error:
        diffjax.generate(model, PROMPTS, 4, **{"draft": "mtp", **options})
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_cli_draft_mtp_prints_the_greedy_tokens_and_the_acceptance(tmp_path, capsys):
    from diffjax.checkpoint import save_params
    from diffjax.generate.__main__ import main

    model = _diff_model(1, layers=1)
    save_params(tmp_path / "run", nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config)
    command = ["--checkpoint", str(tmp_path / "run"), "--prompt-ids", "5,9,2", "--max-new-tokens", "6", "--draft", "mtp"]
    assert main(command) == 0
    out, err = capsys.readouterr()
    assert [int(x) for x in out.split()] == [5, 9, 2] + diffjax.generate(model, [[5, 9, 2]], 6)[0].tolist()
    # compilation apart from the generation's tokens/s, which compares with plain decoding's (issue 62 item 8)
    assert re.search(r"^6 tokens: compiled in [\d.]+ s, generated in [\d.]+ s \([\d.]+ tokens/s; \d+ verify steps, "
                     r"\d+ of \d+ drafts accepted \(\d+%\)\)$", err), err
    assert main(command + ["--temperature", "0.5"]) == 2
    assert "error: draft='mtp' decodes greedily: temperature must be 0, got 0.5" in capsys.readouterr().err
