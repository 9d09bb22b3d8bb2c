"""Peak memory of conversion on a synthetic many-shard checkpoint, measured in a subprocess.

hf-to-diffjax writes each converted tensor into the checkpoint as its shard is read (save_params_streamed):
measured 117 MiB of growth here (211 MiB when it held the converted params for one Orbax save). Its bound, the model +
2 x the largest shard + a fixed allowance for Orbax / tensorstore buffers and thread pools, stays below twice the
model; reading everything first, or Orbax's OCDBT save with its defensive copy (~1.7x the model on top of the
params), breaks it.
diffjax-to-hf reads and writes one tensor at a time: its bound has no model term at all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")  # writes the test's HF files (the converter itself reads them without it)
from safetensors.numpy import load_file, save_file  # noqa: E402

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
FIXED_ALLOWANCE = 96 * MiB


def synthetic_llama(directory: Path, *, D=512, L=12, F=1536, V=4096, H=8, K=4, shard_bytes=10_000_000):
    """A random 160 MiB float32 Llama in ~10 MB shards (written with the safetensors library)."""
    d = D // H
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * d, D), p + "self_attn.k_proj.weight": (K * d, D),
            p + "self_attn.v_proj.weight": (K * d, D), p + "self_attn.o_proj.weight": (D, H * d),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F),
        })
    shapes.update({"model.norm.weight": (D,), "lm_head.weight": (V, D)})
    shards, current, size = [], {}, 0
    for key, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 4
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = shape
        size += nbytes
    shards.append(current)
    directory.mkdir()
    rng = np.random.default_rng(0)
    weight_map, shard_sizes = {}, []
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: rng.standard_normal(s, dtype=np.float32) for k, s in shard.items()}, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard_sizes.append(sum(int(np.prod(s)) * 4 for s in shard.values()))
    total = sum(shard_sizes)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=K, rms_norm_eps=1e-5, max_position_embeddings=512, dtype="float32")))
    return total, sorted(shard_sizes)[-1], len(shards)


def peak_growth(*args) -> tuple[int, str]:
    """Run the CLI; its last stderr line reports peak RSS above the RSS after imports."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "diffjax.convert", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    match = re.search(r"peak memory (\d+) MiB \((-?\d+) MiB above", done.stderr)
    assert match, done.stderr
    return int(match.group(2)) * MiB, done.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS of the child alone needs /proc (VmHWM)")
def test_streaming_conversion_peak_memory(tmp_path, measured):
    model_bytes, largest_shard, shard_count = synthetic_llama(tmp_path / "hf")
    assert shard_count >= 10
    bound = model_bytes + 2 * largest_shard + FIXED_ALLOWANCE
    assert bound < 2 * model_bytes  # the claim: more than half the memory is enough

    growth, line = peak_growth("hf-to-diffjax", tmp_path / "hf", tmp_path / "diffjax")
    print(f"\nhf-to-diffjax, {model_bytes / MiB:.0f} MiB model in {shard_count} shards: {line}; bound {bound / MiB:.0f} MiB")
    measured("hf-to-diffjax peak growth, MiB", growth / MiB, bound / MiB)
    assert growth <= bound

    export_bound = 3 * largest_shard + FIXED_ALLOWANCE
    growth, line = peak_growth("diffjax-to-hf", tmp_path / "diffjax", tmp_path / "back", "--shard-size", "20MB")
    print(f"diffjax-to-hf: {line}; bound {export_bound / MiB:.0f} MiB")
    measured("diffjax-to-hf peak growth, MiB", growth / MiB, export_bound / MiB)
    assert growth <= export_bound

    original, back = {}, {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        original.update(load_file(file))
    assert len(list((tmp_path / "back").glob("*.safetensors"))) >= 6
    for file in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(file))
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
