"""Code-generation report: compile fmoe2's kernels for a GPU that is not there and read the code.

    python -m fmoe2.codegen --target {sm_80,sm_90,sm_100,gfx90a,gfx942,gfx950} [--shape E,H,I,topk] [--m 1,4096]
                            [--lora-rank 16 --num-loras 4] [--fp8 {block,channel,tensor}] [--weights {mxfp4,int4}]
                            [--deterministic]

For each kernel and batch size it prints one JSON object: the config, registers (VGPRs/AGPRs on
AMD), spills, shared memory / LDS bytes, the matrix instructions found and the instructions the
atomic adds into the output lower to (a CAS loop shows as ``cas_loop: true``) and, on CUDA, the
programmatic-dependent-launch instructions and the global loads laid out before the wait. Every launch is
built by the functions :func:`fmoe2.fused_moe` builds its own with (the config picker, ``build_plan``,
``MoEPlan.specs``, ``decode_launch``: :func:`forward_launches`; tests/test_codegen_launches.py compares them with a
forward's for every weight format and path) and compiled with the arguments, constexprs, options and the
divisibility hints Triton's JIT derives, from meta tensors, so no GPU and no memory of real size is needed. This is
how ROCm support is checked without an AMD GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import dataclasses
import functools
import hashlib
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

from ._validation import interpreter_requested
from .formats import WEIGHT_FORMATS
from .fp8 import DEFAULT_BLOCK_SHAPE, SCHEMES, weight_scale_view
from .gemm.config import BACKENDS, FusedMoEConfig, resolve_config
from .gemm.fused_moe import config_problem
from .gemm.launches import MoEProblem, decode_launch, deltas_in_stages
from .gemm.plan import MoEPlan, build_plan
from .gemm.layout import _round_up
from .gemm.lora import PreparedMoELoRA, padded_rank
from .launch import LaunchSpec
from .shapes import SHAPES
from .target import NAMED_TARGETS, Target

# Triton's compile targets of the named GPUs (fmoe2.target.NAMED_TARGETS: A100, H100/H200 SXM, B200,
# MI250X (one die), MI300X, MI355X).
TARGETS = {name: GPUTarget(t.backend, t.arch, 32 if t.backend == "cuda" else 64) for name, t in NAMED_TARGETS.items()}
# Multiprocessors (compute units) and shared memory (LDS) per program of a GPU of each target, for the
# one-wave rule and the pipeline stages of the LoRA fit.
TARGET_MULTIPROCESSORS = {name: t.num_sms for name, t in NAMED_TARGETS.items()}
TARGET_SHARED_MEMORY = {name: t.shared_memory for name, t in NAMED_TARGETS.items()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8",
                 torch.uint8: "u8", torch.int8: "i8"}
# The groups the report compiles weight-only formats with: mxfp4's 32; for int4 and int8 the largest of these that
# divides H and I (prepare_weights refuses the others: gpt-oss's 2880 takes 64).
PACKED_GROUPS = {"mxfp4": (32,), "int4": (128, 64, 32), "int8": (128, 64, 32)}


def packed_group(weights: str, H: int, inter: int) -> int:
    """The group :func:`codegen_report` compiles ``weights`` (a key of :data:`PACKED_GROUPS`) with at H and I."""
    fitting = [g for g in PACKED_GROUPS[weights] if H % g == 0 and inter % g == 0]
    if not fitting:
        raise ValueError(f"{weights} weights need H and I multiples of one of {PACKED_GROUPS[weights]}, got H={H}, "
                         f"I={inter}")
    return fitting[0]


def _signature(fn, args: dict, constexprs: dict, backend: str):
    """Signature and attributes as Triton's JIT derives them from real arguments. A tuple argument (a bundle of
    ``fmoe2/gemm/bundles.py``) is typed element by element, as the JIT does: its signature is a tuple of the same
    type (a NamedTuple keeps its field names), its constexprs and attributes keyed by their paths ``(i, j)``."""
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if name in constexprs or (param.is_constexpr and name not in args):
            signature[name] = "constexpr"
            constexprs.setdefault(name, param.default)  # a constexpr left to its default
            continue
        v = args[name] if name in args else param.default  # arguments left to their defaults
        if isinstance(v, tuple):
            signature[name] = _tuple_signature(v, (i,), attrs, constexprs, backend)
            continue
        kind, hints = _argument_type(v, name, specialize=not param.do_not_specialize, backend=backend)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = v
        elif hints:
            attrs[(i,)] = hints
    return signature, attrs, constexprs


def _tuple_signature(values: tuple, path: tuple, attrs: dict, constexprs: dict, backend: str):
    """The signature of a tuple argument at ``path``; its elements' constexprs and attributes go into
    ``constexprs`` and ``attrs`` by path."""
    kinds = []
    for j, v in enumerate(values):
        if isinstance(v, tuple):
            kinds.append(_tuple_signature(v, path + (j,), attrs, constexprs, backend))
            continue
        kind, hints = _argument_type(v, f"element {path + (j,)}", specialize=True, backend=backend)
        kinds.append(kind)
        if kind == "constexpr":
            constexprs[path + (j,)] = v
        elif hints:
            attrs[path + (j,)] = hints
    return type(values)(*kinds) if hasattr(values, "_fields") else tuple(kinds)


def _argument_type(v, name: str, specialize: bool, backend: str):
    """``(type, attributes)`` of one argument value, as the JIT specialises it: None and ints equal to 1 become
    constexprs (the latter unless ``specialize`` is off), ints divisible by 16 and fresh allocations (256-byte
    aligned) get the divisibility hint."""
    if v is None:
        return "constexpr", None
    if isinstance(v, int) and not isinstance(v, bool) and v == 1 and specialize:
        return "constexpr", None
    if isinstance(v, TensorDescriptor):
        return f"tensordesc<{_TRITON_TYPES[v.base.dtype]}{list(v.block_shape)}>", None
    if isinstance(v, torch.Tensor):
        hints = [["tt.divisibility", 16]]
        if backend == "hip" and v.numel() * v.element_size() <= 2**31 - 1:
            hints.append(["tt.pointer_range", 32])  # what the JIT adds for buffer ops
        return "*" + _TRITON_TYPES[v.dtype], hints
    if isinstance(v, bool):
        return "i1", None
    if isinstance(v, int):
        kind = "i32" if -(2**31) <= v < 2**31 else "i64"
        return kind, [["tt.divisibility", 16]] if v % 16 == 0 and specialize else None
    raise TypeError(f"cannot type argument {name}={v!r}")


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    bundled = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    return bundled if os.path.exists(bundled) else (shutil.which(name) or name)


def _opcode_counts(lines: List[str], pattern: str) -> Dict[str, int]:
    counts = collections.Counter(m.group(0) for line in lines for m in [re.search(pattern, line)] if m)
    return dict(sorted(counts.items()))


@functools.lru_cache(maxsize=None)
def _module_code() -> bytes:
    """This module's source: part of a kept report's key (a report of another version is not read)."""
    with open(__file__, "rb") as f:
        return f.read()


def _report_cache_dir() -> str:
    """Where SASS reports are kept, keyed by the code they read: beside Triton's kernel cache (``TRITON_CACHE_DIR``,
    else ``~/.triton/cache``), so a cache Triton keeps keeps them too."""
    base = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.path.join(base, "fmoe2_sass_reports")


def _report_cuda(compiled) -> dict:
    """:func:`_sass_report` of a compiled CUDA kernel, read back where the same code was reported before: many
    launches compile to the same kernel (a codegen run reports the sort kernels of every problem, and the tests ask for
    the same picks under several flags), and disassembling a kernel takes 0.25-0.4 s, most of a run whose kernels
    Triton's cache already holds."""
    key = hashlib.sha256(_module_code() + compiled.asm["cubin"] + compiled.asm["ptx"].encode()
                         + str(compiled.metadata.shared).encode()).hexdigest()
    path = os.path.join(_report_cache_dir(), key + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    report = _sass_report(compiled)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)  # (whole files only: processes report side by side)
    except OSError:
        pass  # (a read-only cache: the report is still right)
    return report


def longest_loop_opcodes(sass: str) -> Dict[str, int]:
    """Opcode counts (predicates dropped) of the longest loop of a ``cuobjdump --dump-sass`` listing: the
    instructions from a backward branch's target to the branch, once per iteration (the K loop of a GEMM kernel;
    an inner loop's instructions count in the loop around it). Empty without a loop."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    loops = [(int(t.group(1), 16), address) for address, text in code if text.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", text)] if t and int(t.group(1), 16) < address]
    if not loops:
        return {}
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    counts = collections.Counter(text.split()[0] for address, text in code if first <= address <= last)
    return dict(counts.most_common())


def _sass_report(compiled) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True).stdout

    def field(key):
        m = re.search(rf"\b{key}:(\d+)", usage)
        return int(m.group(1)) if m else None

    lines = [ln.split(";")[0] for ln in sass.splitlines() if "/*" in ln]
    matrix = _opcode_counts(lines, r"\b(HGMMA|HMMA|IMMA|QGMMA|UTCHMMA|UTCQMMA)[.\w]*")
    atomics = _opcode_counts(lines, r"\b(ATOMG|REDG|RED|ATOM)\.[.\w]*")
    local_ops = _opcode_counts(lines, r"\b(LDL|STL)\b")
    tensor_copies = _opcode_counts(lines, r"\bUTMALDG[.\w]*")
    return {
        "registers": field("REG"),
        "local_memory_bytes": field("LOCAL"),  # per thread: spills and stack arrays
        "stack_bytes": field("STACK"),
        "spill_instructions": sum(local_ops.values()),  # LDL/STL in the SASS
        # SASS instructions in all (a loop's cost per element, compared between two versions of a kernel)
        "instructions": sum(";" in ln for ln in sass.splitlines() if "/*" in ln),
        # the instructions of the longest loop (a kernel's K loop): one step's cost, by opcode
        "loop_instructions": longest_loop_opcodes(sass),
        "shared_memory_bytes": compiled.metadata.shared,
        "matrix_instructions": matrix,
        "wgmma": any(k.startswith(("HGMMA", "QGMMA")) for k in matrix),
        "atomic_instructions": atomics,
        "cas_loop": any(".CAS" in k for k in atomics),
        "tensor_copy_instructions": tensor_copies,  # UTMALDG: tiles loaded through tensor descriptors
        # cp.async in the PTX: loads the software pipeliner stages through shared memory (num_stages deep)
        "async_copies": len(re.findall(r"\bcp\.async\.c[ag]\b", compiled.asm["ptx"])),
        # griddepcontrol.wait / .launch_dependents: programmatic dependent launch (FusedMoEConfig.pdl)
        "grid_dependency_control": sorted(set(re.findall(r"griddepcontrol\.\w+", compiled.asm["ptx"]))),
        # global loads laid out before the first griddepcontrol.wait in the PTX (None without one): reads
        # of the previous launch's results must come after it
        "global_loads_before_wait": _loads_before_wait(compiled.asm["ptx"]),
    }


def _loads_before_wait(ptx: str):
    if "griddepcontrol.wait" not in ptx:
        return None
    return len(re.findall(r"\bld\.global", ptx[:ptx.index("griddepcontrol.wait")]))


def accumulator_reset_after_reads(ttgir: str) -> Optional[bool]:
    """Whether every store of float32 zeros that follows the first L2 (".cg") load of a kernel comes after a
    barrier that follows every such load before it: the one-launch decode's cast reads its accumulator row,
    then zeroes it, and the compiler may give the zeroing stores a thread layout of their own
    (docs/correctness.md). None where a kernel has no such load followed by such a store."""
    name = r"%[\w.$#-]+"  # an SSA value (%cst_14, %v#1)
    zeros = set(re.findall(rf"({name}) = arith\.constant dense<0\.000000e\+00> : tensor<[0-9x]+xf32", ttgir))
    last_read = barrier = None
    seen = False
    for number, line in enumerate(ttgir.splitlines()):
        if re.search(r"cache_?[mM]odifier = cg\b", line) and re.search(r"\b(tt\.load|amdg\.buffer_load)\b", line):
            last_read = number
        elif re.search(r"\b(gpu\.barrier|ttg\.barrier)\b", line) and "barrier local" not in line:
            # (a barrier the compiler adds for shared memory only, "ttg.barrier local", orders no global memory)
            barrier = number
        else:
            # tt.store %pointers, %values (CUDA); amdg.buffer_store %values, %base[%offsets] (ROCm)
            m = re.search(rf"(?:tt\.store {name}, |amdg\.buffer_store )({name})[, ]", line)
            if m and m.group(1) in zeros and last_read is not None:
                seen = True
                if barrier is None or barrier < last_read:
                    return False
    return True if seen else None


def _report_hip(compiled) -> dict:
    gcn = compiled.asm["amdgcn"]

    def meta(key):
        m = re.search(rf"\.{key}:\s+(\d+)", gcn)
        return int(m.group(1)) if m else None

    lines = [ln.strip() for ln in gcn.splitlines() if not ln.strip().startswith((";", "."))]
    atomics = _opcode_counts(lines, r"^(global|buffer|flat)_atomic_\w+")
    matrix = _opcode_counts(lines, r"^v_mfma_\w+")
    return {
        "vgprs": meta("vgpr_count"),
        "agprs": meta("agpr_count"),
        "sgprs": meta("sgpr_count"),
        "vgpr_spills": meta("vgpr_spill_count"),
        "sgpr_spills": meta("sgpr_spill_count"),
        "scratch_bytes": meta("private_segment_fixed_size"),
        "lds_bytes": compiled.metadata.shared,
        "matrix_instructions": matrix,
        "mfma": bool(matrix),
        "atomic_instructions": atomics,
        "cas_loop": any("cmpswap" in k for k in atomics),
    }


def _compile_spec(spec: LaunchSpec, target: GPUTarget) -> dict:
    """:func:`_compile` of a launch description."""
    return _compile(spec.kernel, spec.grid, spec.args, spec.constexprs, spec.options, target)


def _compile(fn, grid, args, constexprs, options, target: GPUTarget) -> dict:
    signature, attrs, constexprs = _signature(fn, args, constexprs, target.backend)
    t0 = time.time()
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=target, options=dict(options))
    report = {"compile_seconds": round(time.time() - t0, 2), "grid": list(grid),
              "num_warps": options.get("num_warps"), "num_stages": options.get("num_stages")}
    report.update(_report_cuda(compiled) if target.backend == "cuda" else _report_hip(compiled))
    report["accumulator_reset_after_reads"] = accumulator_reset_after_reads(compiled.asm["ttgir"])
    return report


def _meta_lora(num_loras: int, E: int, H: int, inter: int, rank: int, dtype) -> PreparedMoELoRA:
    R_pad, h_pad, i_pad = padded_rank(rank), _round_up(H, 64), _round_up(inter, 64)
    meta = dict(dtype=dtype, device="meta")
    return PreparedMoELoRA(
        a13=torch.empty(num_loras, E, 2 * R_pad, h_pad, **meta), b13=torch.empty(num_loras, E, 2 * R_pad, i_pad, **meta),
        a2=torch.empty(num_loras, E, R_pad, i_pad, **meta), b2=torch.empty(num_loras, E, R_pad, h_pad, **meta),
        scaling=torch.empty(num_loras, dtype=torch.float32, device="meta"), rank=rank, hidden_size=H,
        intermediate_size=inter)


def fp8_weight_dtype(named: Target) -> torch.dtype:
    """The fp8 dtype the report compiles fp8 weights in: the target's (e4m3fnuz on gfx942), e4m3fn where it has
    none (the kernels are still compiled, to read the code)."""
    return named.fp8_dtypes[0] if named.fp8_dtypes else torch.float8_e4m3fn


def _meta_weights(named: Target, E: int, H: int, inter: int, dtype: torch.dtype, prepared: bool, fp8: str,
                  weights: str):
    """``(w1, w2, scales)`` on the meta device as :func:`codegen_report` compiles them (``scales``: the
    ``MoEProblem`` fields of fp8 or 4-bit weights)."""
    meta = dict(device="meta")
    weight_dtype = dtype
    if fp8:
        weight_dtype = fp8_weight_dtype(named)
    scales = {}
    if weights:  # as fmoe2.prepare_weights stores the format: H and I padded to whole groups
        fmt = WEIGHT_FORMATS[weights]
        group, per = packed_group(weights, H, inter), fmt.values_per_element
        h_pad, i_pad = _round_up(H, max(64, group)), _round_up(inter, max(64, group))
        w1 = torch.empty(E, 2 * i_pad, h_pad // per, dtype=fmt.weight_dtypes[0], **meta)
        w2 = torch.empty(E, h_pad, i_pad // per, dtype=fmt.weight_dtypes[0], **meta)
        # Float scales in the activations' dtype, as checkpoints mostly store them (and the int8 loader's 16-bit
        # path takes them: operands._packed_weight_dequant)
        scale_dtype = dtype if dtype in fmt.scale_dtypes else fmt.scale_dtypes[0]
        scales = dict(w1_scale=torch.empty(E, 2 * i_pad, h_pad // group, *fmt.scale_tail, dtype=scale_dtype, **meta),
                      w2_scale=torch.empty(E, h_pad, i_pad // group, *fmt.scale_tail, dtype=scale_dtype, **meta),
                      scale_block=(1, group), weight_format=weights)
    elif prepared:
        h_pad, i_pad = _round_up(H, 64), _round_up(inter, 64)
        w1 = torch.empty(E, 2 * i_pad, h_pad, dtype=weight_dtype, **meta)
        w2 = torch.empty(E, h_pad, i_pad, dtype=weight_dtype, **meta)
    else:
        w1 = torch.empty(E, 2 * inter, H, dtype=weight_dtype, **meta)
        w2 = torch.empty(E, H, inter, dtype=weight_dtype, **meta)
    if fp8:
        block = DEFAULT_BLOCK_SHAPE if fp8 == "block" else None
        shapes = {"block": ((E, -(-2 * inter // 128), -(-H // 128)), (E, -(-H // 128), -(-inter // 128))),
                  "channel": ((E, 2 * inter), (E, H)), "tensor": ((E,), (E,))}[fp8]
        s1, bn, bk, _ = weight_scale_view("w1_scale", torch.empty(shapes[0], dtype=torch.float32, **meta), E,
                                          2 * inter, H, block)
        s2, _, _, _ = weight_scale_view("w2_scale", torch.empty(shapes[1], dtype=torch.float32, **meta), E, H,
                                        inter, block)
        scales = dict(w1_scale=s1, w2_scale=s2, scale_block=(bn, bk))
    return w1, w2, scales


def codegen_report(target_name: str, shape, M: int, dtype: torch.dtype = torch.bfloat16,
                   prepared: bool = True, activation: str = "silu", lora_rank: int = 0,
                   num_loras: int = 4, tma: bool = False, pdl: bool = False, fp8: str = "",
                   deterministic: bool = False, tuned_for: Optional[str] = None, weights: str = "",
                   tail_m: int = 0) -> List[dict]:
    """Compiles the kernels ``fused_moe`` would launch; one dict each.

    Reports ``moe_sorting`` and ``fused_moe`` (the fused path, as ``path="fused"`` runs it) always
    (``moe_sorting_count`` before the sort where it takes two launches, ``sort_chunk_size``), and ``fused_moe_stage1`` and ``moe_stage2`` too when the picked config uses the two-stage path.
    With ``lora_rank`` > 0 the kernels carry ``num_loras`` adapters of that rank: ``moe_sorting_lora``
    (the sort with its count of tokens with an adapter), ``fused_moe_lora`` (the fused path), and
    where the picked config is two-stage, ``lora_shrink13``, ``lora_expand13``,
    ``fused_moe_stage1_lora``, ``lora_shrink2``, ``lora_expand2`` and ``moe_stage2`` instead of the
    plain stage 1 (where the stages compute the deltas, ``lora_in_stages``: ``fused_moe_stage1_lora``
    and ``moe_stage2_lora`` only).
    ``tma`` compiles the configs with ``tma=True`` (weight tiles through tensor descriptors), ``pdl``
    with ``pdl=True`` (programmatic dependent launch). ``fp8`` ("block", "channel" or "tensor"): fp8
    weights of the target's fp8 dtype (e4m3fnuz on gfx942, else e4m3fn) with scales of that scheme
    (block-wise 128 x 128), activations quantized in the kernels; not with ``lora_rank``.
    ``weights`` ("mxfp4", "int4" or "int8"): prepared weight-only quantized weights (``fmoe2/formats.py``; int4
    with (scale, zero) pairs and int8 with scales in ``dtype``, groups of :func:`packed_group`), dequantized in the
    kernels' operand loader.
    ``tuned_for``: the configs of that GPU's tuned files (``fmoe2/gemm/configs/<tuned_for>/``) where it has one
    for the shape, instead of the shipped default rules.
    ``tail_m``: two-stage configs (not fp8) with ``TAIL_M=tail_m`` where it is below their BLOCK_M (tail tiles).
    ``deterministic``: instead, the launches of deterministic mode (``deterministic_sort``,
    ``deterministic_stage1``, ``deterministic_stage2``, ``deterministic_combine``), with adapters of
    ``lora_rank`` where given.
    """
    target = TARGETS[target_name]
    E, H, inter, topk = shape
    common = {"target": target_name, "shape": {"E": E, "H": H, "I": inter, "topk": topk}, "M": M,
              "dtype": str(dtype).replace("torch.", ""), "prepared_weights": prepared}
    launches = codegen_launches(NAMED_TARGETS[target_name], shape, M, dtype, prepared, activation, lora_rank,
                                num_loras, tma, pdl, fp8, deterministic, tuned_for, weights, tail_m)
    extra = {}
    if weights:
        extra["weights"] = {"format": weights, "group": packed_group(weights, H, inter)}
    if fp8:
        weight_dtype = fp8_weight_dtype(NAMED_TARGETS[target_name])
        extra["fp8"] = {"scheme": fp8, "weight_dtype": str(weight_dtype).replace("torch.", "")}
    if lora_rank:
        lora = {"lora": {"rank": lora_rank, "num_loras": num_loras}}
    reports = []
    for launch in launches:
        report = {"kernel": launch.kernel, **common, **extra}
        if launch.lora:
            report.update(lora)
        if launch.chunk_size is not None:
            report["chunk_size"] = launch.chunk_size
        if launch.config is not None:
            report["config"] = launch.config.to_dict()
        reports.append({**report, **_compile_spec(launch.spec, target)})
    return reports


@dataclass(frozen=True)
class CodegenLaunch:
    """One launch the report compiles: its report name, the launch, the config of the forward it belongs to (None
    for a sort and the cast, which do not take its tiles), the sort's chunk size (None for the others), and whether
    it carries adapters."""

    kernel: str
    spec: LaunchSpec
    config: Optional[FusedMoEConfig]
    chunk_size: Optional[int] = None
    lora: bool = False


# Report names of the forward's launches (LaunchSpec.name); the LoRA launches keep theirs.
REPORT_NAMES = {"sort": "moe_sorting", "sort_count": "moe_sorting_count", "fused": "fused_moe",
                "stage1": "fused_moe_stage1", "stage2": "moe_stage2", "cast": "cast"}


def forward_launches(problem: MoEProblem, config: FusedMoEConfig, target: Target, activation: str
                     ) -> Tuple[MoEPlan, List[LaunchSpec], Optional[LaunchSpec]]:
    """The plan, the launches and the one-launch decode (None where the plan has none) of a forward of ``problem``
    with the fitted ``config`` on ``target``, built by the functions :func:`fmoe2.fused_moe` builds its own with
    (:func:`fmoe2.gemm.plan.build_plan`, ``MoEPlan.specs``, ``launches.decode_launch``), on the meta device."""
    meta = dict(device="meta")
    M = problem.num_tokens
    out = torch.empty(M, problem.hidden_size, dtype=problem.x.dtype, **meta)
    topk_ids = torch.empty(M, problem.topk, dtype=torch.int32, **meta)
    topk_weights = torch.empty(M, problem.topk, dtype=torch.float32, **meta)
    plan = build_plan(problem, activation, config, target, topk_weights, topk_ids, out, None, bindable=False)
    block = torch.empty(plan.scratch_bytes, dtype=torch.uint8, **meta)
    specs = plan.specs(problem, topk_weights, topk_ids, out, None, block)
    decode = None
    if plan.decodes:
        kept = torch.empty(plan.decode_numel, dtype=torch.float32, **meta)
        decode = decode_launch(problem, topk_weights, topk_ids, activation, out, None, config, target, kept)
    return plan, specs, decode


def codegen_launches(named: Target, shape, M: int, dtype: torch.dtype = torch.bfloat16, prepared: bool = True,
                     activation: str = "silu", lora_rank: int = 0, num_loras: int = 4, tma: bool = False,
                     pdl: bool = False, fp8: str = "", deterministic: bool = False, tuned_for: Optional[str] = None,
                     weights: str = "", tail_m: int = 0, path: str = "auto") -> List[CodegenLaunch]:
    """The launches :func:`codegen_report` compiles (its arguments; ``named``: the target's
    :class:`~fmoe2.target.Target`), each built as the forward builds it (:func:`forward_launches`): the fused path's
    forward (its sort, ``fused_moe`` and its ``cast``) and one-launch decode; with ``lora_rank``, the fused path's
    forward with adapters (``*_lora``); where the config picked for ``path`` ("auto", or "two_stage" to force it) is
    two-stage, that forward's launches after its sort. Deterministic mode: its one forward, named
    ``deterministic_<launch>``."""
    if fp8 and fp8 not in SCHEMES:
        raise ValueError(f"fp8 must be one of {SCHEMES} or empty, got {fp8!r}")
    if fp8 and lora_rank:
        raise ValueError("fp8 weights do not take LoRA adapters yet")
    if weights and (weights not in PACKED_GROUPS or fp8 or not prepared):
        raise ValueError(f"weights must be one of {tuple(PACKED_GROUPS)} (prepared, without fp8), got {weights!r}")
    E, H, inter, topk = shape
    meta = dict(device="meta")
    x = torch.empty(M, H, dtype=dtype, **meta)
    w1, w2, scales = _meta_weights(named, E, H, inter, dtype, prepared, fp8, weights)
    problem = MoEProblem(x, w1, w2, prepared, E, H, inter, topk, **scales)
    problem.deterministic = deterministic
    lora_problem = None
    if lora_rank:
        lora_problem = dataclasses.replace(problem, lora=_meta_lora(num_loras, E, H, inter, lora_rank, dtype),
                                           token_lora_ids=torch.empty(M, dtype=torch.int32, **meta))

    def resolve(problem, path):  # the picker's config; the report's tail, tma and pdl options on top
        config_shape, mode = config_problem(problem)
        cfg = resolve_config(config_shape, mode, named, path=path, tuned_for=tuned_for)
        if tail_m and cfg.path == "two_stage" and not fp8 and tail_m < cfg.BLOCK_M:
            cfg = replace(cfg, TAIL_M=tail_m)
        return cfg if deterministic else replace(cfg, tma=(cfg.tma or tma) and not fp8 and not weights
                                                 and BACKENDS[named.backend].tensor_descriptor_weights(named),
                                                 pdl=(cfg.pdl or pdl) and named.has_grid_dependency_control)

    out: List[CodegenLaunch] = []
    names = set()  # each report name once: the forwards reported share launches (their sort, the cast)

    def add(plan, specs, lora, rename, skip=()):
        for spec in specs:
            if spec.name in skip:
                continue
            kernel = rename(spec.name)
            if kernel in names:
                continue
            names.add(kernel)
            tiled = not spec.name.startswith("sort") and spec.name != "cast"  # (the config's tiles: GEMM launches)
            out.append(CodegenLaunch(kernel, spec, plan.config if tiled else None,
                                     plan.chunk_size if spec.name == "sort" else None, lora))

    if deterministic:
        chosen = lora_problem or problem
        plan, specs, _ = forward_launches(chosen, resolve(chosen, "auto"), named, activation)
        add(plan, specs, lora_problem is not None, lambda n: "deterministic_" + n)
        return out
    plan, specs, decode = forward_launches(problem, resolve(problem, "fused"), named, activation)
    add(plan, specs, False, lambda n: REPORT_NAMES.get(n, n))
    if decode is not None:  # eager calls of one token: the fused kernel alone
        add(plan, [replace(decode, name="decode")], False, lambda n: "fused_moe_decode")
    if lora_problem is not None:
        plan, specs, _ = forward_launches(lora_problem, resolve(lora_problem, "fused"), named, activation)
        add(plan, specs, True, lambda n: {"sort": "moe_sorting_lora", "sort_count": "moe_sorting_lora_count",
                                          "fused": "fused_moe_lora"}.get(n, n), skip=("cast",))
    chosen = lora_problem or problem
    config = resolve(chosen, path)
    if config.path == "two_stage":
        suffix = "_lora" if lora_problem is not None else ""
        in_stages = lora_problem is not None and deltas_in_stages(chosen, config)
        plan, specs, _ = forward_launches(chosen, config, named, activation)
        stage_names = {"stage1": "fused_moe_stage1" + suffix, "stage2": "moe_stage2" + (suffix if in_stages else "")}
        add(plan, specs, lora_problem is not None, lambda n: stage_names.get(n, n), skip=("sort", "sort_count", "cast"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe2.codegen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", required=True, choices=sorted(TARGETS))
    parser.add_argument("--shape", default="mixtral-8x7b",
                        help=f"one of {sorted(SHAPES)} or E,H,I,topk (default mixtral-8x7b)")
    parser.add_argument("--m", default="1,4096", help="comma-separated batch sizes (default 1,4096)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--activation", default="silu", choices=["silu", "gelu", "gelu_tanh"])
    parser.add_argument("--plain", action="store_true", help="plain weight layout instead of prepared")
    parser.add_argument("--lora-rank", type=int, default=0, help="also compile the fused kernel with LoRA of this rank")
    parser.add_argument("--num-loras", type=int, default=4, help="adapters with --lora-rank (default 4)")
    parser.add_argument("--tma", action="store_true", help="configs with tma=True (tensor-descriptor weight loads)")
    parser.add_argument("--pdl", action="store_true", help="configs with pdl=True (programmatic dependent launch)")
    parser.add_argument("--fp8", default="", choices=("",) + SCHEMES,
                        help="fp8 weights with scales of this scheme (block-wise: 128 x 128); --dtype is the activations'")
    parser.add_argument("--weights", default="", choices=("",) + tuple(PACKED_GROUPS),
                        help="prepared 4-bit weights (mxfp4; int4 with the largest group of 128, 64, 32 that divides H and "
                             "I), dequantized in the kernels")
    parser.add_argument("--deterministic", action="store_true",
                        help="the launches of deterministic mode instead (fused_moe(..., deterministic=True))")
    parser.add_argument("--tuned-for", default=None,
                        help="the configs of this GPU's tuned files (a folder of fmoe2/gemm/configs, e.g. NVIDIA_H200) "
                             "instead of the default rules, where it has one for the shape")
    parser.add_argument("--tail-m", type=int, default=0,
                        help="two-stage configs with TAIL_M of this many rows (tail tiles; where below BLOCK_M)")
    a = parser.parse_args(argv)
    if a.fp8 and a.lora_rank:
        parser.error("--fp8 does not take --lora-rank: fp8 weights take no LoRA adapters yet")
    if a.weights and (a.fp8 or a.plain):
        parser.error("--weights (4-bit, prepared) takes neither --fp8 nor --plain")
    if interpreter_requested():
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    if a.shape in SHAPES:
        shape = SHAPES[a.shape]
    else:
        try:
            shape = tuple(int(v) for v in a.shape.split(","))
            assert len(shape) == 4 and min(shape) >= 1
        except (ValueError, AssertionError):
            parser.error(f"--shape must be one of {sorted(SHAPES)} or four positive ints E,H,I,topk, got {a.shape!r}")
    try:
        ms = [int(m) for m in a.m.split(",")]
    except ValueError:
        parser.error(f"--m must be comma-separated ints, got {a.m!r}")
    for M in ms:
        for report in codegen_report(a.target, shape, M, DTYPES[a.dtype], not a.plain, a.activation, a.lora_rank,
                                     a.num_loras, a.tma, a.pdl, a.fp8, a.deterministic, a.tuned_for, a.weights,
                                     a.tail_m):
            print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
