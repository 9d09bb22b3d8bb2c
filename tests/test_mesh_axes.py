"""The mesh axes have one owner, diffjax.mesh_axes.AXES: the mesh's order, the sharding rules, the batch axes and the
expert-parallel row split are read from it, so that a new axis is a row there (and its ParallelConfig field) and
nothing else. Read from the source with ast: no other module writes two mesh axis names in one tuple, list or set."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from diffjax import mesh_axes, sharding
from diffjax.config import BLOCK_PARTS
from diffjax.mesh_axes import AXES, MESH_AXES, MeshAxis, ParallelConfig, splitting
from diffjax.ops import expert_parallel

PACKAGE = Path(__file__).resolve().parents[1] / "diffjax"


def test_a_new_batch_axis_joins_the_batch_split_and_the_expert_row_split():
    pipeline = MeshAxis("pipeline", splits=("batch",))
    table = AXES[:1] + (pipeline,) + AXES[1:]
    assert splitting("batch", table) == ("data", "pipeline", "fsdp", "expert")
    assert expert_parallel.row_order(table) == ("data", "pipeline", "fsdp", "expert", "context", "tensor")
    # the module's own split is the table's (its batch axes first: the rows' existing split)
    assert expert_parallel.ROW_AXES == expert_parallel.row_order(AXES)
    assert expert_parallel.ROW_AXES[:len(mesh_axes.BATCH_AXES)] == mesh_axes.BATCH_AXES
    assert dict(sharding.LOGICAL_AXIS_RULES)["batch"] == mesh_axes.BATCH_AXES


def test_the_rules_name_every_logical_axis_the_table_splits_and_the_kinds_axes_exist():
    split = {name for axis in AXES for name in axis.splits}
    assert split <= set(sharding.LOGICAL_AXES), split - set(sharding.LOGICAL_AXES)
    kinds_axes = {axis for table in BLOCK_PARTS.values() for row in table.rows() for axis in row.training.mesh_axes}
    assert kinds_axes <= set(MESH_AXES), kinds_axes


def test_parallel_config_sizes_every_mesh_axis():
    fields = [field.name for field in dataclasses.fields(ParallelConfig)]
    assert tuple(fields[:len(MESH_AXES)]) == MESH_AXES


def axis_lists_in(source: str) -> list[int]:
    """Lines of tuple / list / set literals holding two or more mesh axis names."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                  and sum(isinstance(e, ast.Constant) and e.value in MESH_AXES for e in node.elts) >= 2)


def test_the_search_finds_spelled_axis_lists():
    source = 'A = ("data", "fsdp", X)\nB = ["tensor"]\nC = {"context", "expert"}\nD = ("data", "model")\n'
    assert axis_lists_in(source) == [1, 3]


def test_no_module_but_the_owner_spells_the_mesh_axes():
    found = {f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "mesh_axes.py" for line in axis_lists_in(path.read_text())}
    assert not found, f"mesh axes listed by hand (read them from diffjax.mesh_axes.AXES instead): {sorted(found)}"
