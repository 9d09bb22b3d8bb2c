"""The collectives of a compiled XLA program, from its text (`jax.stages.Compiled.as_text()`): bytes per device per
run of the program, by kind. Pure (no jax).

A collective counts once per execution: its computation's executions (a while body's by its trip count: XLA's
`known_trip_count`, else the loop condition's `i < N` bound; a conditional's branches as the largest one) times one.
Inside fusions, instructions of one kind that share a `channel_id` in one turn of their caller are one collective:
TPU's compiled programs split an asynchronous collective over a start fusion, the fusions it overlaps and a done
fusion, each holding a copy (outside fusions every instruction counts: XLA:CPU numbers every channel 1). A TPU
reduce-scatter is an all-reduce inside a fusion whose emitter is "AllReduceScatterFusion": counted as one.
Bytes: what one device's share of the collective holds: an all-gather's gathered result, a reduce-scatter's input
(its result times the group), an all-reduce's, all-to-all's and collective-permute's result.
"""

from __future__ import annotations

import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OPCODES = {**{opcode: kind for kind in KINDS for opcode in (kind, f"{kind}-start")},
            "ragged-all-to-all": "all-to-all"}  # (an asynchronous collective counts at its start, not its done)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)")


class Instruction:
    __slots__ = ("name", "type", "opcode", "rest")

    def __init__(self, name, type_, opcode, rest):
        self.name, self.type, self.opcode, self.rest = name, type_, opcode, rest


def parse_computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions}, the entry computation's name) of an HLO module's text."""
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        if current is None:
            if match := _COMPUTATION.match(line):
                current = match[2]
                computations[current] = []
                entry = current if match[1] else entry
        elif line.startswith("}"):
            current = None
        elif match := _INSTRUCTION.match(line):
            computations[current].append(Instruction(*match.groups()))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def array_bytes(type_text: str) -> list[float]:
    """The bytes of each array in an HLO type (an array or a tuple of them), in order."""
    sizes = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _BYTES or re.fullmatch(r"f8e\d+m\d+\w*", dtype):
            sizes.append(math.prod(int(d) for d in dims.split(",") if d) * _BYTES.get(dtype, 1))
    return sizes


def group_size(rest: str) -> int:
    """Devices in each replica group of a collective (its `replica_groups` in any of XLA's three spellings)."""
    if match := re.search(r"replica_groups=\{(\{[^=]*?\})\}", rest):
        return len(re.search(r"\{([^{}]*)\}", match[1])[1].split(","))
    if match := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest):
        return int(match[2])
    if match := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match[1]))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'(\w+)'", match[2]))
    raise ValueError(f"no replica_groups in {rest[:120]!r}")


def tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of an HLO tuple type ("(f32[4], (f32[8], s32[]))" -> ["f32[4]", "(f32[8], s32[])"]);
    an array type is its own one element."""
    text = re.sub(r"/\*.*?\*/", "", type_text.strip())
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if (char == "," and depth == 1) or (char == ")" and depth == 0):
            elements.append(text[start:i].strip())
            start = i + 1
    return [element for element in elements if element]


def _collective_bytes(instruction: Instruction, kind: str) -> float:
    if kind == "all-reduce":  # its result is its input
        return sum(array_bytes(instruction.type))
    if instruction.opcode.endswith("-start"):  # async: (its operands, its results, [flags])
        operands, results = tuple_elements(instruction.type)[:2]
        return sum(array_bytes(operands if kind == "reduce-scatter" else results))
    total = sum(array_bytes(instruction.type))
    return total * group_size(instruction.rest) if kind == "reduce-scatter" else total


def trip_count(instruction: Instruction, computations: dict[str, list[Instruction]]) -> int | None:
    """A while loop's iterations: XLA's known_trip_count, else N in a condition `i < N` with one integer constant."""
    if match := re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.rest):
        return int(match[1])
    condition = re.search(r"condition=%?([\w.\-]+)", instruction.rest)[1]
    body = computations.get(condition, [])
    constants = [int(m[1]) for i in body if i.opcode == "constant" and re.match(r"[su]\d+\[\]", i.type)
                 for m in [re.match(r"(-?\d+)\)", i.rest)] if m]
    if len(constants) == 1 and any("direction=LT" in i.rest for i in body if i.opcode == "compare"):
        return constants[0]
    return None


def collective_bytes(text: str) -> tuple[dict[str, float], list[str]]:
    """({kind: bytes per device per run of the program} for every kind in KINDS, notes on what could not be counted
    exactly) of a compiled program's HLO text."""
    computations, entry = parse_computations(text)
    totals, notes = dict.fromkeys(KINDS, 0.0), []

    def visit(name: str, times: float, seen_channels: set, fused: bool = False, scatter: bool = False) -> None:
        for instruction in computations.get(name, []):
            if (kind := _OPCODES.get(instruction.opcode)) is not None:
                if scatter and kind == "all-reduce":  # TPU's reduce-scatter: an all-reduce in a scattering fusion
                    kind = "reduce-scatter"
                channel = re.search(r"channel_id=(\d+)", instruction.rest)
                key = (kind, channel and channel[1])
                if not (fused and channel is not None and key in seen_channels):
                    totals[kind] += times * (sum(array_bytes(instruction.type)) if scatter else
                                             _collective_bytes(instruction, kind))
                if channel is not None:
                    seen_channels.add(key)
            if instruction.opcode == "while":
                trips = trip_count(instruction, computations)
                if trips is None:
                    notes.append(f"{instruction.name}: trip count unknown, counted once")
                body = re.search(r"body=%?([\w.\-]+)", instruction.rest)[1]
                visit(body, times * (trips or 1), set())
            elif branches := _BRANCHES.findall(instruction.rest):
                names = [b.strip().lstrip("%") for listed, single in branches
                         for b in (listed.split(",") if listed else [single])]
                before = dict(totals)
                largest = dict.fromkeys(KINDS, 0.0)
                for branch in names:  # one branch runs: the largest
                    totals.update(before)
                    visit(branch, times, set())
                    largest = {k: max(largest[k], totals[k] - before[k]) for k in KINDS}
                totals.update({k: before[k] + largest[k] for k in KINDS})
            else:  # fusions, calls and async wrappers run in their caller's turn (one channel: one collective)
                for attribute, called in _CALLED.findall(instruction.rest):
                    if attribute == "calls":
                        scatters = scatter or '"AllReduceScatterFusion"' in instruction.rest
                        visit(called, times, seen_channels, True, scatters)
                    elif attribute == "to_apply" and instruction.opcode == "call":
                        visit(called, times, seen_channels, fused)

    visit(entry, 1.0, set())
    return totals, notes

