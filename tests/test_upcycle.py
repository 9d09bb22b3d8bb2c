"""Upcycling a pretrained Transformer to DIFF (diffjax.convert.upcycle): the upcycled model's logits equal those of
the source as transformers' LlamaForCausalLM computes them (GQA, llama3 RoPE), every new parameter trains, the
CLI writes a run directory that loads, and what cannot start as the source is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import diffjax  # noqa: E402
from diffjax.convert import upcycle  # noqa: E402
from diffjax.convert.__main__ import main  # noqa: E402
from diffjax.convert.common import ConversionError  # noqa: E402
from diffjax.convert.export import check_exportable  # noqa: E402
from diffjax.params_checkpoint import load_model  # noqa: E402
from diffjax.run_dir import RunDir  # noqa: E402
from diffjax.train.config import load_run_config  # noqa: E402
from hf_models import LLAMA3_ROPE, make_hf_model, max_relative_error, random_tokens  # noqa: E402

FP32_TOL = 1e-5
OPTIONS = {
    "v1_mirror_schedule": dict(kind="diff"),
    "v1_mirror_constant": dict(kind="diff", lambda_init=0.8),
    "v1_zero_query": dict(kind="diff", second_map="zero_query", lambda_init=0.0),
    "v2_mirror": dict(kind="diff_v2"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama with GQA (8 heads, 2 kv heads) and llama3 RoPE, saved as users have it, and its logits."""
    hf = make_hf_model("llama", num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, vocab_size=260)  # >= 257 bytes
    directory = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(directory)
    tokens = random_tokens(hf.config.vocab_size)
    with torch.no_grad():
        logits = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    return directory, tokens, logits


@pytest.mark.parametrize("option", [pytest.param(o, marks=pytest.mark.slow) if o == "v1_mirror_schedule" else o
                                    for o in OPTIONS])
def test_the_upcycled_model_computes_the_llamas_logits(option, llama, measured):
    directory, tokens, expected = llama
    model = upcycle(diffjax.load_hf(directory), **OPTIONS[option])
    assert model.config.attention == OPTIONS[option]["kind"] and model.config.num_heads == 8
    assert model.config.subln is False or model.config.attention == "diff_v2"
    err = measured(f"upcycled ({option}) vs transformers Llama logits, max rel (fp32)",
                   max_relative_error(model(jnp.asarray(tokens)), expected), FP32_TOL)
    assert err <= FP32_TOL


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
@pytest.mark.slow
def test_every_new_parameter_trains(kind, llama):
    """At step 0 every parameter has a gradient except V1's new value half, which enters through zero rows of o:
    those rows have one, so after one step the new values have one too."""
    directory, tokens, _ = llama
    model = upcycle(diffjax.load_hf(directory), kind)
    tokens = jnp.asarray(tokens)

    loss_grads = nnx.jit(nnx.grad(lambda m, t: diffjax.next_token_loss(m(t), t)))

    def grads_of(model):
        return dict(nnx.to_flat_state(loss_grads(model, tokens)))

    grads = grads_of(model)
    d = model.config.head_dim
    for path, grad in grads.items():
        g = np.asarray(grad[...])
        if path[-1] == "v_kernel" and kind == "diff":
            assert np.abs(g[..., :d]).max() > 0 and np.abs(g[..., d:]).max() == 0, "the new values start silent"
        else:
            assert np.abs(g).max() > 0, path
    if kind == "diff":
        assert np.abs(np.asarray(grads[("blocks", "attn", "o_kernel")][...])[:, :, d:]).max() > 0
        params = nnx.state(model, nnx.Param)
        for path, variable in nnx.to_flat_state(params):  # one SGD step
            variable[...] = variable[...] - 0.1 * grads[path][...]
        nnx.update(model, params)
        assert np.abs(np.asarray(grads_of(model)[("blocks", "attn", "v_kernel")][...])[..., d:]).max() > 0


WARMUP_OPTIONS = {
    "v1_mirror_schedule": dict(kind="diff"),
    "v1_zero_query_schedule": dict(kind="diff", second_map="zero_query"),
    "v2_zero_query": dict(kind="diff_v2", second_map="zero_query"),
}


@pytest.mark.parametrize("option", list(WARMUP_OPTIONS))
def test_upcycled_for_a_lambda_warmup_it_starts_as_the_llama_at_lambda_scale_0(option, llama, measured):
    """With lambda x 0 (a warm-up's first step) any second map is silent: the model is the source there, and only
    there (at full lambda it differs)."""
    directory, tokens, expected = llama
    model = upcycle(diffjax.load_hf(directory), **WARMUP_OPTIONS[option], lambda_warmup=True)
    err = measured(f"upcycled for a lambda warm-up ({option}) at lambda x 0 vs transformers Llama, max rel (fp32)",
                   max_relative_error(model(jnp.asarray(tokens), lambda_scale=0.0), expected), FP32_TOL)
    assert err <= FP32_TOL
    assert max_relative_error(model(jnp.asarray(tokens), lambda_scale=1.0), expected) > 100 * FP32_TOL


@pytest.mark.slow
def test_the_trainer_warms_lambda_up_from_the_source(llama):
    """Train steps with optim.lambda_warmup_steps on an upcycled model: the first step's loss is the Llama's, the
    logged lambda_scale is min(1, step / W), and the loss moves away from the source's as lambda grows."""
    import optax

    from diffjax.train.config import RunConfig
    from diffjax.train.optimizer import OptimizerConfig, make_optimizer
    from diffjax.train.step import init_state, make_train_step

    directory, tokens, _ = llama
    source = diffjax.load_hf(directory)
    model = upcycle(source, "diff", lambda_warmup=True)
    optim = OptimizerConfig(lr=1e-3, warmup_steps=0, lambda_warmup_steps=2)
    tx, schedule = make_optimizer(optim, total_steps=10)
    run = RunConfig(model=model.config, optim=optim)  # (the facet of the model's attention reads the warm-up there)
    step = jax.jit(make_train_step(nnx.graphdef(model), tx, schedule, model.config, run=run))
    tokens = jnp.asarray(tokens)
    batch = {"tokens": tokens[None], "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)[None],
             "segment_ids": jnp.ones_like(tokens)[None]}
    source_loss = float(diffjax.next_token_loss(source(tokens), tokens))
    state = init_state(model, tx, jax.random.key(0))
    scales = []
    for _ in range(3):
        state, metrics = step(state, batch)
        scales.append(float(metrics["lambda_scale"]))
        if len(scales) == 1:
            assert float(metrics["loss"]) == pytest.approx(source_loss, rel=1e-5)
    assert scales == [0.0, 0.5, 1.0]
    assert optax.tree.norm(state["params"]) > 0


@pytest.mark.slow
def test_the_cli_writes_a_run_directory_that_loads(llama, tmp_path, capsys, measured):
    directory, tokens, expected = llama
    run = tmp_path / "up"
    assert main(["upcycle", str(directory), str(run), "--kind", "diff"]) == 0
    assert "train.run_dir=" in capsys.readouterr().out
    err = max_relative_error(load_model(run)(jnp.asarray(tokens)), expected)
    assert measured("upcycled run directory vs transformers Llama logits, max rel (fp32)", err, FP32_TOL) <= FP32_TOL
    # (train.py continuing from a converted run directory: tests/test_convert_roundtrip.py)
    assert main(["upcycle", str(run), str(tmp_path / "again")]) == 2  # a DIFF source: one line on stderr
    assert "the source must be a Transformer" in capsys.readouterr().err
    # For a lambda warm-up: the run directory's config trains with it, and the model is the source at lambda x 0.
    warm = tmp_path / "warm"
    assert main(["upcycle", str(directory), str(warm), "--second-map", "zero_query", "--lambda-warmup", "50"]) == 0
    assert load_run_config(RunDir(warm).config_file).optim.lambda_warmup_steps == 50
    assert max_relative_error(load_model(warm)(jnp.asarray(tokens), lambda_scale=0.0), expected) <= FP32_TOL
    assert main(["upcycle", str(directory), str(tmp_path / "bad"), "--lambda-warmup", "-1"]) == 2
    assert "lambda_warmup_steps must be an integer >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("call,message", [
    (dict(kind="diff", second_map="zero_query"), r"'zero_query' starts as the source only with lambda_init 0"),
    (dict(kind="diff_v2", second_map="zero_query"), r"'diff_v2' starts as the source with second_map 'mirror' only"),
    (dict(kind="diff_v2", lambda_init=0.5), r"lambda_init applies to kind 'diff'"),
    (dict(kind="shared_diff"), r"kind must be one of \('diff', 'diff_v2'\)"),
    (dict(kind="diff", second_map="copy"), r"second_map must be one of \('mirror', 'zero_query'\)"),
])
def test_what_cannot_start_as_the_source_is_refused(call, message, llama):
    with pytest.raises(ConversionError, match=message):
        upcycle(diffjax.load_hf(llama[0]), **call)


def test_a_diff_source_and_a_normless_export_are_refused():
    config = diffjax.ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2)
    with pytest.raises(ConversionError, match=r"the source must be a Transformer \(attention 'standard'.*got attention 'diff'"):
        upcycle(diffjax.TransformerLM(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ConversionError, match=r"subln=false: HF diffllama always normalizes each head's output"):
        check_exportable(config.replace(subln=False))
    assert config.replace(subln=False).param_count() == config.param_count() - 2 * config.head_dim
    from diffjax.convert import unilm_attention_state_dict
    from diffjax.model import DiffAttention

    layer = DiffAttention(config.replace(subln=False), depth=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unilm's modules always normalize each head's output"):
        unilm_attention_state_dict(layer)
