"""Checks that a program updates the KV pool in place: the pool is aliased input to output and no
pool-sized copy or rewrite appears. Used by tests/test_kv_aliasing.py (CPU compile, `cuda` export)
and by scripts/gpu_check.sh (the same checks on programs compiled for the GPU).

Why both levels: the StableHLO shows what JAX asks for (donation, the Pallas kernels' operand
aliasing); only the compiled HLO shows what XLA did with it (copy insertion around the layer
scan, scatter fusions that write a fresh buffer). Each check returns a list of problems
(empty: in place), so a failure says which instruction copies the pool.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.interpreters import mlir
from jaxlib.mlir import ir

# HLO opcodes that may produce a pool-shaped value without writing a new pool-sized buffer.
# scatter / dynamic-update-slice are in place only on a buffer XLA could share; a copy XLA had to
# insert to make that possible shows up as its own `copy` instruction (caught below).
_HLO_IN_PLACE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "scatter",
                 "dynamic-update-slice", "fusion", "custom-call", "call", "conditional",
                 "optimization-barrier"}
_FUSION_ROOTS = {"scatter", "dynamic-update-slice", "custom-call", "tuple", "bitcast", "parameter"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][a-z0-9-]*)\(")
_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint16": "u16", "int8": "s8",
              "uint8": "u8", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}


def hlo_shape(shape: tuple[int, ...], dtype) -> str:
    """The HLO spelling of an array type, e.g. f32[2,2,37,16,16]."""
    return f"{_HLO_DTYPE[np.dtype(dtype).name]}[{','.join(map(str, shape))}]"


def mlir_type(shape: tuple[int, ...], dtype) -> str:
    """The MLIR spelling, e.g. tensor<2x2x37x16x16xf32>."""
    name = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint16": "ui16", "int8": "i8"}
    return f"tensor<{'x'.join(map(str, shape))}x{name[np.dtype(dtype).name]}>"


def compiled_problems(compiled: jax.stages.Compiled, shape: tuple[int, ...], dtype, num_pools: int = 2) -> list[str]:
    """Problems in a compiled program (any backend): the pool parameters not aliased to outputs,
    pool-shaped copies, pool-shaped results of ops that write a new buffer, and memory analysis
    that shows a pool-sized temporary or less aliased memory than the pools."""
    text = compiled.as_text()
    pool = hlo_shape(shape, dtype)
    problems = _alias_problems(text, pool, num_pools)
    computations = _computations(text)
    for comp, lines in computations.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m or not m.group(2).startswith(pool + "{") and m.group(2) != pool:
                continue
            name, op = m.group(1), m.group(3)
            if op not in _HLO_IN_PLACE:
                problems.append(f"{comp}: %{name} = {op}(...) writes a new pool-sized buffer")
            elif op == "fusion":
                callee = re.search(r"calls=%([\w.-]+)", line)
                root = _root_opcode(computations.get(callee.group(1), [])) if callee else None
                if root not in _FUSION_ROOTS:
                    problems.append(f"{comp}: fusion %{name} produces the pool from a {root} (not in place)")
    pool_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    stats = compiled.memory_analysis()
    if stats is not None:
        if stats.alias_size_in_bytes < num_pools * pool_bytes:
            problems.append(f"memory analysis: {stats.alias_size_in_bytes} bytes aliased < {num_pools} pools "
                            f"of {pool_bytes}")
        if stats.temp_size_in_bytes >= pool_bytes:
            problems.append(f"memory analysis: {stats.temp_size_in_bytes} temporary bytes >= one pool "
                            f"({pool_bytes}): a pool-sized temporary")
    return problems


def _alias_problems(text: str, pool: str, num_pools: int) -> list[str]:
    header = next((line for line in text.splitlines() if line.startswith("HloModule")), "")
    aliased = {int(p) for p in re.findall(r"\{[\d,\s]*\}:\s*\((\d+),", header.split("input_output_alias=")[-1]
                                            .split("entry_computation_layout")[0])} \
        if "input_output_alias=" in header else set()
    entry = _computations(text).get(_entry_name(text), [])
    params = [int(m.group(1)) for line in entry
              if (m := re.search(r"=\s*" + re.escape(pool) + r"\{[^}]*\}\s+parameter\((\d+)\)", line))]
    problems = [] if len(params) >= num_pools else [f"{len(params)} pool-shaped parameters, expected {num_pools}"]
    return problems + [f"pool parameter {p} is not aliased to an output" for p in params if p not in aliased]


def _entry_name(text: str) -> str:
    m = re.search(r"^ENTRY %([\w.-]+)", text, re.M)
    return m.group(1) if m else ""


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%([\w.-]+)\s.*\{\s*$", line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _root_opcode(lines: list[str]) -> str | None:
    for line in lines:
        if line.lstrip().startswith("ROOT"):
            m = _INSTR.match(line)
            return m.group(3) if m else None
    return None


def stablehlo_problems(module_text: str, shape: tuple[int, ...], dtype, num_pools: int = 2,
                       allow_scatter: bool = False) -> list[str]:
    """Problems in a lowered (not compiled) module, e.g. jax.export for `cuda`: main's pool
    arguments not donated/aliased, and pool-typed results of anything but control flow, calls and
    custom calls that alias an operand (the Pallas write_kv); `allow_scatter`: a scatter into
    the pool argument itself (the block-copy programs, which XLA performs in place on a donated
    buffer, as the compiled check shows on the CPU)."""
    pool = mlir_type(shape, dtype)
    problems = []
    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        ops = _walk(module.operation, [])
        main = next(o for o in ops if o.name == "func.func" and ir.StringAttr(o.attributes["sym_name"]).value == "main")
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        arg_attrs = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else []
        pool_args = [i for i, t in enumerate(ftype.inputs) if str(t) == pool]
        if len(pool_args) < num_pools:
            problems.append(f"{len(pool_args)} pool arguments in main, expected {num_pools}")
        for i in pool_args:
            attrs = str(arg_attrs[i]) if i < len(arg_attrs) else ""
            if "tf.aliasing_output" not in attrs and "jax.buffer_donor" not in attrs:
                problems.append(f"main argument {i} (the pool) is neither aliased nor donated: {attrs}")
        for o in ops:
            if pool not in [str(r.type) for r in o.results]:
                continue
            if o.name in ("stablehlo.while", "func.call", "call", "stablehlo.optimization_barrier"):
                continue
            if o.name == "stablehlo.custom_call" and "output_operand_aliases" in o.attributes:
                continue
            if allow_scatter and o.name == "stablehlo.scatter" and str(o.operands[0].type) == pool \
                    and isinstance(o.operands[0].owner, ir.Block):
                continue
            problems.append(f"{o.name} produces a pool-typed value (a full-pool write or copy)")
    return problems


def _walk(op, out: list) -> list:
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                out.append(o.operation)  # the Operation, not its OpView (FuncOp.name is the symbol)
                _walk(o.operation, out)
    return out
