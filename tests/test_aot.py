"""The device a call is compiled for (diffjax.ops.target) and compiling for hardware that is not here
(diffjax.ops.aot): the kernels compile for their target, not for this CPU. The whole kernel matrix per TPU
generation and for an H100: tests/test_aot_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax import ops, sharding
from diffjax.jax_compat import lowering_target
from diffjax.ops import aot, target

CPU = ops.Device("cpu", "cpu")


def test_the_compile_device_is_the_abstract_meshs_then_the_activation_meshs_then_the_default():
    assert target.compile_device() == CPU and target.interpreted("tpu") and target.interpreted("gpu")
    with lowering_target("TPU v5 lite", platform="tpu"):
        assert target.compile_device() == ops.DEVICES["v5e"] and not target.interpreted("tpu")
        with ops.simulated_device(ops.DEVICES["h100"]):  # routes as on an H100; compiles for the v5e still
            assert ops.current_device() == ops.DEVICES["h100"] and target.compile_device() == ops.DEVICES["v5e"]
    with sharding.activation_sharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))):
        assert target.compile_device() == CPU
    with jax.default_device(jax.devices()[1]):
        assert target.compile_device() == CPU
    assert ops.current_device() == CPU


def test_auto_routes_by_the_device_it_compiles_for():
    """Under a v5e's abstract device `auto` takes the Pallas TPU kernel, and it lowers as a Mosaic kernel (not its
    interpreter, which has no custom call): what compile_for gives a topology's device."""
    spec = jax.ShapeDtypeStruct
    q = spec((1, 256, 2, 128), jnp.bfloat16)

    def f(q, k, v):
        return ops.dot_product_attention(q, k, v)

    with lowering_target("TPU v5 lite", platform="tpu") as tpu:
        text = jax.jit(f).trace(q, q, q).lower(lowering_platforms=(tpu,)).as_text()
    assert text.count("tpu_custom_call") == 1
    cpu_text = jax.jit(f).trace(q, q, q).lower().as_text()
    assert "tpu_custom_call" not in cpu_text and "pallas" not in cpu_text  # auto on a CPU: XLA


@pytest.mark.parametrize("name, problem", [
    ("v7", "a TPU generation"), ("v5e:2x", "chips per dimension"), ("h100x", "a GPU"), ("h100:2x2", "a GPU")])
def test_a_target_name_it_cannot_read_is_one_line_naming_what_it_takes(name, problem):
    with pytest.raises(ValueError, match=problem):
        aot.target(name)


@pytest.fixture(scope="module")
def v5e():
    if why := aot.missing("tpu"):
        pytest.skip(why)
    return aot.target("v5e")


def test_a_topologys_devices_are_the_generations_and_compile_the_mosaic_kernel(v5e):
    """4 "TPU v5 lite" devices; a pallas_tpu call compiled for them (a one-device mesh: no shard_map) holds the
    Mosaic kernel, forward and backward, and XLA's memory figures per device."""
    assert v5e.name == "v5e:2x2" and len(v5e.devices) == 4 and v5e.device == ops.DEVICES["v5e"]
    one = jax.sharding.NamedSharding(aot.Target("v5e:1", v5e.devices[:1]).mesh(), jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16, sharding=one)

    def loss(q, k, v):
        with jax.named_scope("case"):
            return ops.dot_product_attention(q, k, v, impl="pallas_tpu").astype(jnp.float32).sum()

    with aot.compile_for(v5e):
        assert ops.compile_device() == ops.DEVICES["v5e"]
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
    assert ops.compile_device() == CPU  # only around the compile
    assert aot.kernel_calls(compiled.as_text(), scope="case") == {
        "diffjax_flash_fwd_m1": 1, "diffjax_flash_bwd_dq_m1": 1, "diffjax_flash_bwd_dkv_m1": 1}
    assert aot.kernel_calls(compiled.as_text(), scope="another") == {}
    assert compiled.memory_analysis().argument_size_in_bytes == 3 * 256 * 2 * 128 * 2


def test_jaxs_own_mesh_context_names_the_device_too(v5e):
    """jax.set_mesh with a topology's mesh: its abstract mesh carries the device, which compile_for then keeps."""
    with jax.set_mesh(v5e.mesh()):
        assert ops.compile_device() == ops.DEVICES["v5e"]
        with aot.compile_for(v5e):
            assert ops.compile_device() == ops.DEVICES["v5e"]
        with pytest.raises(ValueError, match="compile_for"):
            with aot.compile_for(jax.devices()[0]):
                pass
    assert ops.compile_device() == CPU


def test_every_generations_device_kind_is_what_routes_name_it(v5e):
    """DEVICES' TPU kinds are the topologies' own (a v5p is "TPU v5" to jax, not "TPU v5p")."""
    for generation in aot.TPU_GENERATIONS:
        devices = aot.tpu_target(generation).devices
        assert aot.Target(generation, devices).device == ops.DEVICES[generation], generation


def test_a_one_device_topology_mesh_outside_compile_for_is_one_line_naming_it(v5e):
    """Under the train step's mesh of one topology device (no shard_map, so no abstract mesh) the kernel compiles
    for that TPU, and jax's Mosaic lowering would read this CPU's kind: the error says to use compile_for."""
    mesh = aot.Target("v5e:1", v5e.devices[:1]).mesh((1,), ("data",))
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with sharding.activation_sharding(mesh), pytest.raises(ValueError, match="inside diffjax.ops.aot.compile_for"):
        jax.jit(lambda q, k, v: ops.dot_product_attention(q, k, v)).lower(q, q, q)
    with sharding.activation_sharding(mesh), aot.compile_for(mesh):
        text = jax.jit(lambda q, k, v: ops.dot_product_attention(q, k, v)).lower(q, q, q).compile().as_text()
    assert aot.kernel_calls(text) == {"diffjax_flash_fwd_m1": 1}
