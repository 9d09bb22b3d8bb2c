"""The checkpoint formats' table (diffjax.convert.formats): each format detected once, from a config.json or a
ModelConfig, and the two agree; a format defined in this file converts in and out with no edit under
diffjax/convert/, and one sharing Llama's attention kind registers beside Llama's; two formats holding one config are
refused at registration; exports keep every config.json key diffjax does not model; no module under diffjax/convert/
but the format modules names a model_type or a kind; the table and the format modules need no jax."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import attention_kinds, mlp_kinds, residual_kinds
from diffjax.checkpoint import load_model
from diffjax.convert import ConversionError, diffjax_to_hf, formats, hf_to_diffjax, llama
from diffjax.convert.formats import Configs, Not
from diffjax.convert.weight_plan import COPY, TRANSPOSED, Row, causal_lm_plan, linear, out_projection

from motif3_published import PUBLISHED, small_config

REPO_ROOT = Path(__file__).resolve().parents[1]
CONVERT = REPO_ROOT / "diffjax" / "convert"
SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# One config.json per built-in format, and the format each is.
SAMPLES = {
    "llama": {"model_type": "llama", **SIZES},
    "diffllama": {"model_type": "diffllama", **SIZES},
    "motif": {"model_type": "Motif", **SIZES, "hidden_act": "poly_norm"},  # DIFF V1
    "motif_gda": {"model_type": "motif", **SIZES, "num_attention_heads": 6, "num_noise_heads": 2, "head_dim": 8},
    "motif3": {"model_type": "Motif", **small_config()},
}


# ------------------------------------------------------------------------------ detection


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_format_is_detected_from_config_json_and_derived_from_its_model_config_alike(sample):
    hf = SAMPLES[sample]
    row = formats.detect(hf)
    assert row.name == sample.removesuffix("_gda")
    config = formats.model_config(row, hf)
    assert formats.of_config(config) is row  # what it was read as is what it exports as
    assert formats.config_from_hf(hf) == config


def test_unknown_model_types_and_unheld_kinds_are_one_line_each():
    with pytest.raises(ConversionError, match=r"model_type 'mistral' is not supported; supported: \('diffllama', "
                                              r"'llama', 'motif'\) \(in any case\)$"):
        formats.detect({"model_type": "mistral"})
    config = diffjax.ModelConfig(attention="diff_v2", num_layers=1)
    with pytest.raises(ConversionError, match=r"attention='diff_v2': Hugging Face has DiffLlama \(attention 'diff'\), "
                                              r"Llama \(attention 'standard'\), Motif \(attention 'diff', 'gda'\), "
                                              r"Motif 3 \(attention 'gdla'\) only$"):
        formats.of_config(config)


def test_a_model_type_has_one_plain_format():
    twin = formats.CheckpointFormat(name="llama_twin", label="Twin", model_type="llama", architecture="X",
                                    holds=(), config_in=dict, config_out=dict, weight_plan=list)
    with pytest.raises(ValueError, match=r"model_type 'llama' already has a plain format \('llama'\)"):
        formats.register(twin)
    assert "llama_twin" not in formats.names()


# ------------------------------------------------------------------------------ a toy format, defined here


def _toy_attention_rows(config, hf: str, leaf) -> list[Row]:
    """DIFF V2's projections as whole tensors, q / k channels stored in diffjax's (unilm's interleaved) order."""
    D, H, K, d = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    return [Row(hf + "q_proj.weight", (H * 2 * d, D), (leaf("attn", "q_kernel"),), *linear((H, 2, d))),
            Row(hf + "k_proj.weight", (K * d, D), (leaf("attn", "k_kernel"),), *linear((K, d))),
            Row(hf + "v_proj.weight", (K * d, D), (leaf("attn", "v_kernel"),), *linear((K, d))),
            Row(hf + "o_proj.weight", (D, H * d), (leaf("attn", "o_kernel"),), *out_projection(D, H, d)),
            Row(hf + "lambda_proj.weight", (H, D), (leaf("attn", "lambda_kernel"),), *linear((H,)))]


TOY = formats.CheckpointFormat(
    name="toy_diff_v2", label="ToyDiffV2", model_type="toydiffv2", spelling="ToyDiffV2",
    architecture="ToyDiffV2ForCausalLM", holds=(Configs(attention="diff_v2", **llama.LAYER_KINDS),),
    config_in=lambda hf: {**llama.config_fields(hf, default_eps=1e-6), "attention": "diff_v2",
                          "rope_style": "interleaved"},
    config_out=lambda config: llama.config_json(config, heads=1),
    weight_plan=lambda config: llama.plan(config, _toy_attention_rows),
    export_problems=lambda config: llama.export_problems(config, "toydiffv2"),
    skipped={"model.toy_extras.": "an example of tensors a format reads past"},
)


@pytest.fixture
def toy_format():
    formats.register(TOY)
    yield TOY
    formats.unregister(TOY.name)


def _toy_directory(directory: Path) -> dict:
    """A ToyDiffV2 checkpoint as its own tools would write it: config.json (with a key diffjax does not model) and
    random tensors in two safetensors shards with an index."""
    from safetensors.numpy import save_file

    hf = {"model_type": "ToyDiffV2", "architectures": ["ToyDiffV2ForCausalLM"], **SIZES, "head_dim": 4,
          "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0, "rope_theta": 10000.0,
          "rope_scaling": None, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "use_cache": True,
          "dtype": "float32", "torch_dtype": "float32", "toy_tokenizer_hint": {"bos": 1, "eos": [2, 3]}}
    config = formats.model_config(TOY, hf)
    rng = np.random.default_rng(0)
    tensors = {row.key: rng.standard_normal(row.shape, dtype=np.float32) for row in TOY.weight_plan(config)}
    tensors["model.toy_extras.counter"] = np.zeros(3, np.float32)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    directory.mkdir()
    for file, keys in shards.items():
        save_file({key: tensors[key] for key in keys}, directory / file, metadata={"format": "pt"})
    index = {"weight_map": {key: file for file, keys in shards.items() for key in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(hf))
    return tensors


def test_a_format_defined_in_a_test_file_converts_in_and_out_bit_exact(toy_format, tmp_path):
    """ToyDiffV2 is registered through the table only (nothing under diffjax/convert/ names it): HF-style directory
    -> diffjax run directory -> HF-style directory gives every tensor bit for bit and the same config.json."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    tensors = _toy_directory(tmp_path / "toy")
    hf_to_diffjax(tmp_path / "toy", tmp_path / "run")
    model = load_model(tmp_path / "run")
    assert model.config.attention == "diff_v2"
    H, d, D = model.config.num_heads, model.config.head_dim, model.config.d_model  # the rows' layout, by hand:
    q_proj = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.q_kernel[1]),
                                  q_proj.reshape(H, 2, d, D).transpose(3, 0, 1, 2))
    diffjax_to_hf(tmp_path / "run", tmp_path / "back", max_shard_size="4KB")
    back = {}
    for file in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(file))
    assert sorted(back) == sorted(set(tensors) - {"model.toy_extras.counter"})
    for key, value in back.items():
        assert value.dtype == tensors[key].dtype and np.array_equal(value, tensors[key]), key
    source = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == source
    exported = diffjax.save_hf(model, tmp_path / "bare")  # no source config.json: the format's own spelling
    assert json.loads((exported / "config.json").read_text())["model_type"] == "ToyDiffV2"


# ------------------------------------------------------------------------------ what a format holds


def _toy_moe_layer_rows(config, depth: int, hf: str, leaf) -> list[Row]:
    """Llama's norms and attention, then the MoE kind's router and experts as transformers 5 fuses Qwen3-MoE's
    (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]), with the experts' PolyNorm coefficients."""
    D, E, inner = config.d_model, config.mlp_options.num_experts, config.mlp_options.expert_inner
    swap = (0, 2, 1)
    return [Row(hf + "input_layernorm.weight", (D,), (leaf("attn_norm", "scale"),), *COPY),
            Row(hf + "post_attention_layernorm.weight", (D,), (leaf("mlp_norm", "scale"),), *COPY),
            *llama.attention_rows(config, hf + "self_attn.", leaf),
            Row(hf + "mlp.gate.weight", (E, D), (leaf("mlp", "router_kernel"),), *TRANSPOSED),
            Row(hf + "mlp.experts.gate_up_proj", (E, 2 * inner, D),
                (leaf("mlp", "expert_gate_kernel"), leaf("mlp", "expert_up_kernel")),
                lambda w: (w[:, :inner].transpose(swap), w[:, inner:].transpose(swap)),
                lambda gate, up: np.concatenate([gate.transpose(swap), up.transpose(swap)], axis=1)),
            Row(hf + "mlp.experts.down_proj", (E, D, inner), (leaf("mlp", "expert_down_kernel"),),
                lambda w: (w.transpose(swap),), lambda w: w.transpose(swap)),
            Row(hf + "mlp.experts.act_fn.weight", (E, 3), (leaf("mlp", "expert_polynorm_weight"),), *COPY),
            Row(hf + "mlp.experts.act_fn.bias", (E, 1), (leaf("mlp", "expert_polynorm_bias"),), *COPY)]


TOY_MOE = formats.CheckpointFormat(
    name="toy_qwen3_moe", label="ToyQwen3MoE", model_type="toyqwen3moe", architecture="ToyQwen3MoeForCausalLM",
    holds=(Configs(attention="standard", mlp="moe", residual="plain"),),  # Llama's attention kind, another MLP
    config_in=lambda hf: {**llama.config_fields(hf, default_eps=1e-6), "attention": "standard", "mlp": "moe",
                          "mlp_options": {"num_experts": hf["num_experts"], "top_k": hf["num_experts_per_tok"],
                                          "expert_inner": hf["moe_intermediate_size"]}},
    config_out=lambda config: {**llama.config_json(config, heads=1), "num_experts": config.mlp_options.num_experts,
                               "num_experts_per_tok": config.mlp_options.top_k,
                               "moe_intermediate_size": config.mlp_options.expert_inner},
    weight_plan=lambda config: causal_lm_plan(config, _toy_moe_layer_rows),
    export_problems=lambda config: llama.export_problems(config, "toyqwen3moe"),
)


def test_a_format_sharing_llamas_attention_kind_registers_beside_llamas(tmp_path):
    """A Qwen3-MoE-like format (Llama's attention kind and tensors, the MoE kind's MLP) registers from this file with
    no edit to diffjax.convert.llama: Llama's row holds its MLP kind only. A checkpoint of it loads as it and exports
    back bit-exact; Llama's models still export as Llama."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file, save_file

    hf = {"model_type": "toyqwen3moe", "architectures": ["ToyQwen3MoeForCausalLM"], **SIZES, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "max_position_embeddings": 64}
    config = formats.model_config(TOY_MOE, hf)
    with pytest.raises(ConversionError, match=r"^cannot export to Hugging Face \(Llama\): mlp='moe': Llama holds "
                                              r"mlp 'gated' only$"):
        formats.of_config(config)
    formats.register(TOY_MOE)
    try:
        assert formats.of_config(config) is TOY_MOE
        assert formats.of_config(config.replace(mlp="gated", mlp_options=None)) is llama.FORMAT
        rng = np.random.default_rng(0)
        tensors = {row.key: rng.standard_normal(row.shape, dtype=np.float32) for row in TOY_MOE.weight_plan(config)}
        (tmp_path / "toy").mkdir()
        save_file(tensors, tmp_path / "toy" / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / "toy" / "config.json").write_text(json.dumps(hf))
        model = diffjax.load_hf(tmp_path / "toy")
        assert model.config == config and model.config.mlp_options.num_experts == 4
        back = load_file(diffjax.save_hf(model, tmp_path / "back") / "model.safetensors")
        assert sorted(back) == sorted(tensors)
        for key, value in back.items():
            np.testing.assert_array_equal(value, tensors[key], err_msg=key)
    finally:
        formats.unregister(TOY_MOE.name)


@pytest.mark.parametrize("holds,message", [
    ((Configs(attention="standard"),),  # any MLP: Llama's gated one too
     r"format 'toy' would hold configs format 'llama' holds \(attention 'standard', mlp 'gated', residual 'plain'\)"),
    ((Configs(attention="gdla", mlp="gated"), Configs(attention=("diff", "gda"), activation="gelu")),
     r"format 'toy' would hold configs format 'diffllama' holds \(attention 'diff', activation 'gelu', "
     r"lambda_init_depth_offset 0, mlp 'gated', residual 'plain'\)"),
    ((Configs(attention="diff", activation=Not("polynorm", "gelu")),),  # DiffLlama's and Motif's offset -1 configs
     r"format 'toy' would hold configs format '(diffllama|motif)' holds \(attention 'diff', activation not "
     r"'polynorm', 'gelu'"),
])
def test_two_formats_holding_one_config_are_refused_at_registration(holds, message):
    toy = formats.CheckpointFormat(name="toy", label="Toy", model_type="toy", architecture="X", holds=holds,
                                   config_in=dict, config_out=dict, weight_plan=list)
    with pytest.raises(ValueError, match=message) as error:
        formats.register(toy)
    assert "\n" not in str(error.value) and "toy" not in formats.names()
    formats.register(dataclasses.replace(toy, holds=(Configs(attention="gdla", mlp="gated"),)))  # held by none
    formats.unregister("toy")


def test_configs_are_sets_of_model_configs():
    config = diffjax.ModelConfig(num_layers=1, activation="gelu")
    assert config in Configs(attention="diff", activation=Not("polynorm"))
    assert config not in Configs(attention=("standard", "gda"))
    assert Configs(attention="diff", activation=Not("gelu")).overlap(Configs(activation="gelu")) is None
    assert Configs(mlp=Not("moe")).overlap(Configs(mlp=Not("gated"))).describe() == "mlp not 'moe', 'gated'"
    with pytest.raises(ValueError, match=r"Configs: \['atention'\] are not ModelConfig fields"):
        Configs(atention="diff")


# ------------------------------------------------------------------------------ keys diffjax does not model


def _round_trip_config(tmp_path, model, source: dict) -> dict:
    """source (a config.json for `model`) as an HF directory's, through hf-to-diffjax and diffjax-to-hf."""
    diffjax.save_hf(model, tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(source))
    hf_to_diffjax(tmp_path / "src", tmp_path / "run")
    return json.loads((diffjax_to_hf(tmp_path / "run", tmp_path / "back") / "config.json").read_text())


def test_a_diffllama_export_keeps_every_key_it_does_not_model(tmp_path):
    config = diffjax.ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=64)
    model = diffjax.TransformerLM(config, rngs=nnx.Rngs(0))
    source = diffjax.convert.hf_config(config)
    source["rope_parameters"]["partial_rotary_factor"] = 1.0  # (transformers 5 keeps it there; diffjax reads it)
    source.update(pad_token_id=0, use_bias=False, my_pipeline_setting={"stage": [1, 2]})
    written = _round_trip_config(tmp_path, model, source)
    assert {key: written.get(key) for key in source} == source


@pytest.mark.slow
def test_a_motif3_export_keeps_every_key_it_does_not_model(tmp_path):
    source = {"model_type": "Motif", **small_config(), "attention_dropout": 0.0, "output_router_logits": False,
              "router_aux_loss_coef": 0.0, "max_window_layers": 2}
    source["rope_scaling"].update(rope_theta=10000.0, apply_yarn_scaling=False)
    model = diffjax.TransformerLM(formats.config_from_hf(source), rngs=nnx.Rngs(0))
    written = _round_trip_config(tmp_path, model, source)
    assert {key: written.get(key) for key in source} == source


# ------------------------------------------------------------------------------ formats are rows, not branches

# Under diffjax/convert/, only these modules (the table and one module per family) name a format or a kind.
FORMAT_MODULES = {"formats", "llama", "diffllama", "motif", "motif3", "motif3_weights", "unilm"}
# The names other modules there may use, each with its reason.
ALLOWED_NAMES = {
    "upcycle": {"standard", "diff", "diff_v2"},  # upcycling turns a model of one named kind into another: no format
    "__main__": {"diff", "diff_v2"},  # upcycle's --kind choices (upcycle.KINDS; the parser is built before jax loads)
}


def _named(path: Path, words: set[str]) -> set[str]:
    """The string constants of a module (docstrings aside) that are, in any case, one of `words`."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and node.value.lower() in words}


def _imported_convert_modules(path: Path) -> set[str]:
    """The diffjax.convert modules a module imports (`from diffjax.convert import motif`, `diffjax.convert.motif`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "diffjax.convert":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffjax.convert."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[2] for alias in node.names if alias.name.startswith("diffjax.convert.")}
    return found


def test_no_module_but_the_format_modules_names_a_format_or_a_kind():
    """A string constant (docstrings aside) equal, in any case, to a registered kind's name (attention, MLP,
    residual), a format's name, model_type or spelling, or "model_type" is a format branch (a model_type test, a
    kind-name test, a config.json's model_type read), and so is importing a family's module (motif3.is_motif3...):
    outside FORMAT_MODULES only ALLOWED_NAMES may appear, and only the package face imports unilm (its functions)."""
    words = {"model_type"} | {name.lower() for table in (attention_kinds, mlp_kinds, residual_kinds)
                              for name in table.names()}
    words |= {word.lower() for row in formats.rows() for word in (row.name, row.model_type, row.spelling) if word}
    others = [path for path in sorted(CONVERT.glob("*.py")) if path.stem not in FORMAT_MODULES]
    assert {path.stem: names for path in others if (names := _named(path, words))} == ALLOWED_NAMES
    families = FORMAT_MODULES - {"formats"}
    imports = {path.stem: found for path in others if (found := _imported_convert_modules(path) & families)}
    assert imports == {"__init__": {"unilm"}}
    assert {path.stem for path in CONVERT.glob("*.py")} >= FORMAT_MODULES  # (a renamed module is struck off here)


def test_the_table_and_the_format_modules_read_config_json_without_jax():
    """config.json -> ModelConfig, the weight plan and config.json again at the published Motif 3 size, with the
    package's __init__ (load_hf, save_hf: jax) left out: neither jax nor flax is imported."""
    code = f"""
import json, sys, types
import diffjax
package = types.ModuleType("diffjax.convert")
package.__path__ = [{str(CONVERT)!r}]
sys.modules["diffjax.convert"] = package
from diffjax.convert import formats
hf = json.loads({json.dumps(PUBLISHED)!r})
row = formats.detect(hf)
config = formats.model_config(row, hf)
assert formats.of_config(config) is row and len(row.weight_plan(config)) > 1000
formats.config_json(row, config, dtype="bfloat16", source=hf)
print(" ".join(sorted({{name.split(".")[0] for name in sys.modules}})))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert not {"jax", "flax"} & set(done.stdout.split())
