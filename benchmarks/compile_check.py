"""Compile every Moira kernel for the H200 (sm_90) without a GPU, and report its registers.

Triton's wheel carries NVIDIA's ptxas, so a CPU machine can build the GPU binaries the H200
would run: a kernel that only ever ran in the interpreter is checked to compile, and a change's
register cost (occupancy) is seen before device time is spent. Llama-3.1-8B geometry (G = 4,
D = 128, bf16 cache, 64-token pages) first, then edge geometries (G = 1, 7, 8; D = 64; Select
on 64 to 16,384 lanes), with the package's default tuning (``moira/kernels/tuning.py``), then
the tuning candidates the sweeps time (``tune.py``, ``kernel_bench.py suite``'s Attend arms), then
the CUDA kernels built by NVRTC. ``.ci/run`` requires no CUDA kernel to spill under the GPU
host's NVRTC (``build_cuda``).

    python3 benchmarks/compile_check.py        # must run without TRITON_INTERPRET

Prints one line per kernel: registers per thread, spilled bytes (local memory), shared memory.
Exits non-zero if a kernel fails to compile or spills.
"""

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moira.benchmarking import imposed  # noqa: E402
from moira.config import KernelOptions  # noqa: E402
from moira.kernels.cuda import attend as attend_cuda  # noqa: E402
from moira.kernels.cuda import build as cuda_build  # noqa: E402
from moira.kernels.cuda import estimate as estimate_cuda  # noqa: E402
from moira.kernels.cuda import estimate_select as estimate_select_cuda  # noqa: E402
from moira.kernels.cuda import select as select_cuda  # noqa: E402
from moira.kernels.triton import attend, estimate, merge, select, summarize  # noqa: E402

# the package's defaults (moira/kernels/tuning.py), as every kernel is built by default
DEFAULTS = KernelOptions()

TARGET = GPUTarget("cuda", 90, 32)  # H200
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
GROUP, HEAD_DIM, PAGE = 4, 128, 64
CACHE = dict(query="*bf16", key_cache="*bf16", value_cache="*bf16", out="*bf16",
             summaries="*bf16", new_keys="*bf16", new_values="*bf16", codes="*u8")
INDICES = dict(block_table="*i32", seq_lens="*i32", page_lists="*i32", page_counts="*i32",
               slot_mapping="*i32", page_stats="*i64")
FLOATS = dict(log_masses="*fp32", partial_out="*fp32", partial_lse="*fp32", row_values="*fp32",
              scale="fp32", gamma="fp32", qk_scale_log2="fp32", fractions="*fp32",
              log_tokens="*fp32", tables="*fp32")


def specialize(kernel, constexprs, **types_by_name):
    """``(signature, constexprs, attrs)`` as Triton's launcher builds them for a real launch:
    every argument's type by its name (pointers and floats as listed, other scalars i32); the
    unit strides of the last (channel) dimension become the constant 1, and pointers and the
    strides of the cache, summary, query and output tensors are marked divisible by 16 (what
    the launcher sees for contiguous bf16 tensors of these shapes), so loads vectorize as they
    do on the GPU. Without that the build spills and misleads."""
    types = {**CACHE, **INDICES, **FLOATS, **types_by_name}
    constexprs = dict(constexprs)
    attrs = {}
    for index, name in enumerate(kernel.arg_names):
        if name.startswith("stride_") and name.endswith("d"):
            constexprs[name] = 1
        elif name in types and types[name].startswith("*") or (
                name.startswith("stride_") and name[7] in "qkvso"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32")
                 for name in kernel.arg_names}
    return signature, constexprs, attrs


def check_waits_first(name, ptx):
    """A kernel built for programmatic launch must wait for the previous kernel before any
    access to global memory (``moira/kernels/launch.py``): fail if the PTX lacks either
    griddepcontrol instruction or touches memory before the wait."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0 or "griddepcontrol.launch_dependents" not in ptx:
        sys.exit(f"{name}: built for programmatic launch without griddepcontrol instructions")
    early = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async", ptx[:wait])
    if early:
        sys.exit(f"{name}: {early.group(0)} before griddepcontrol.wait")


def build(name, kernel, constexprs, num_warps, num_stages=3, maxnreg=None, **types_by_name):
    signature, constexprs, attrs = specialize(kernel, constexprs, **types_by_name)
    pdl = bool(constexprs.get("PDL"))
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           launch_pdl=pdl, maxnreg=maxnreg))
    if pdl:
        check_waits_first(name, compiled.asm["ptx"])
    usage = sass = ""
    if os.path.exists(CUOBJDUMP):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moira-{os.getpid()}.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", path], capture_output=True,
                              text=True).stdout
        os.remove(path)
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    # spills land in the stack frame (STACK) or in local memory (LOCAL)
    registers, local = ((int(found.group(1)), int(found.group(2)) + int(found.group(4)))
                        if found else (None, None))
    # block-wide barriers and warp shuffles in the binary: the reductions' cost, statically
    barriers, shuffles = (len(re.findall(rf"\b{op}\b", sass)) for op in ("BAR", "SHFL"))
    print(f"{name:<40} registers {registers}  spilled bytes {local}  shared "
          f"{compiled.metadata.shared}  barriers {barriers}  shuffles {shuffles}", flush=True)
    return local


def kernels(group, head_dim, block, pdl=False):
    """(name, kernel, constexprs, warps, stages, maxnreg) of every kernel for one geometry,
    with the launch settings the package uses; ``block``: Select's lanes (the table's pages,
    rounded up to a power of two); ``pdl``: the decode-step kernels built for programmatic
    dependent launch (``moira/kernels/launch.py``), and summarize left out."""
    warps = select.num_warps(block, DEFAULTS.value("select.eight_warps_from"))
    lanes = min(block, 32 * warps)
    group_pad = triton.next_power_of_2(group)
    tag = f"G={group} D={head_dim}" + (" PDL" if pdl else "")
    decode_step = [
        (f"estimate {tag}", estimate._estimate_kernel,
         dict(GROUP=group, GROUP_DOT=group_pad, CODE_DOT=max(16, group_pad), BITS=0,
              HEAD_DIM=head_dim, PAGE=PAGE, BLOCK_P=DEFAULTS.value("estimate.pages_per_program"),
              EXACT=DEFAULTS.value("estimate.exact_pages"), WRITE_KV=False,
              QUERY_AHEAD=DEFAULTS.value("estimate.query_head_ahead"), PDL=pdl),
         DEFAULTS.value("estimate.num_warps"), 3, estimate.max_registers(group, DEFAULTS)),
        *[(f"select {mode} {tag} lanes={block}", select._select_kernel,
           dict(GROUP=group, BLOCK=block, BLOCK_2=max(lanes, block // 2),
                BLOCK_4=max(lanes, block // 4), BLOCK_8=max(lanes, block // 8), WAYS=4,
                PASSES=12, FIXED_COUNT=fixed, FRACTIONS=fractions, ROW_GAMMAS=gammas,
                PAGE=PAGE, GROUP_PAD=group_pad,
                SOFTMAX_TILE=DEFAULTS.value("select.softmax_tile"), PDL=pdl),
           warps, 3, None)
          for mode, fixed, fractions, gammas in (("coverage", False, False, False),
                                                 ("fractions", True, True, False),
                                                 ("row gammas", False, False, True))],
        (f"attend {tag}", attend._attend_kernel,
         dict(GROUP=group, GROUP_PAD=max(16, group_pad), HEAD_DIM=head_dim, PAGE=PAGE,
              PAGES_PER_TILE=DEFAULTS.value("attend.pages_per_iter"),
              SUM_ROUNDED=DEFAULTS.value("attend.sum_rounded_weights"),
              FA3_ORDER=DEFAULTS.value("attend.fa3_tile_order"),
              EVEN_CHUNKS=DEFAULTS.value("attend.even_chunks"),
              PAGES_AHEAD=DEFAULTS.value("attend.page_ids_ahead"), PDL=pdl),
         DEFAULTS.value("attend.num_warps"), DEFAULTS.value("attend.num_stages"),
         DEFAULTS.value("attend.max_registers")),
        (f"merge {tag}", merge._merge_kernel,
         dict(GROUP=group, HEAD_DIM=head_dim, SPLITS_PAD=32, SPLITS_PER_LOAD=32,
              HAS_STATS=True, PAGE=PAGE, EVEN_CHUNKS=DEFAULTS.value("attend.even_chunks"),
              PDL=pdl), 4, 3, None),
    ]
    if pdl:
        return decode_step
    return decode_step + [
        (f"summarize (filled slots) D={head_dim}", summarize._summarize_filled_slots_kernel,
         dict(HEAD_DIM=head_dim, PAGE=PAGE, BITS=0), 4, 3, None),
        ("imposed fractions (32 layers x 8 heads)", imposed._imposed_fractions_kernel,
         dict(KNOTS=8, ENTRIES=256), 4, 3, None)]


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's jit cannot be compiled
        sys.exit("compile_check.py compiles for the GPU: run it without TRITON_INTERPRET=1")
    # Llama-3.1-8B in a 131k-token engine first, then the edge geometries the tests cover
    geometries = [(GROUP, HEAD_DIM, 2048, False), (1, 64, 64, False), (7, 64, 512, False),
                  (8, 128, 16384, False), (GROUP, HEAD_DIM, 2048, True)]
    spilled = [name for group, head_dim, block, pdl in geometries
               for name, kernel, constexprs, warps, stages, maxnreg
               in kernels(group, head_dim, block, pdl)
               if build(name, kernel, constexprs, warps, stages, maxnreg)]
    # the options in tune.py's sweeps: Estimate's exact pages side by side (at G = 4 and 8)
    # and each head's query in its turn, and Attend with FA3's loop order and normalizer
    # (what vllm_checks.py --fa3-arithmetic runs)
    for group in (GROUP, 8):
        for name, kernel, constexprs, warps, stages, maxnreg in kernels(group, HEAD_DIM, 2048):
            if name.startswith("estimate") and build(
                    f"{name} exact side by side", kernel,
                    dict(constexprs, EXACT="side by side"), warps, stages, maxnreg):
                spilled.append(f"{name} exact side by side")
    for name, kernel, constexprs, warps, stages, maxnreg in kernels(GROUP, HEAD_DIM, 2048):
        if name.startswith("estimate") and build(f"{name} query head in turn", kernel, dict(
                constexprs, QUERY_AHEAD=False), warps, stages, maxnreg):
            spilled.append(f"{name} query head in turn")
        # the decode token's cache write in Estimate's launch (sparse_decode's new_keys, the
        # plugin's fused_cache_write); vLLM's slot_mapping is int64
        if name.startswith("estimate") and build(f"{name} writing the new tokens", kernel, dict(
                constexprs, WRITE_KV=True), warps, stages, maxnreg, slot_mapping="*i64"):
            spilled.append(f"{name} writing the new tokens")
        if name.startswith("attend") and build(f"{name} FA3 order", kernel, dict(
                constexprs, FA3_ORDER=True, SUM_ROUNDED=False), warps, stages, maxnreg):
            spilled.append(f"{name} FA3 order")
        if name.startswith("attend"):  # kernel_bench.py suite's moira_ahead<P><S> arms
            for per_tile, ahead_stages, ahead_warps in ((1, 3, 4), (1, 3, 8), (1, 4, 4),
                                                        (2, 3, 4)):
                label = (f"{name} page ids ahead, {per_tile} pages per tile, {ahead_stages} "
                         f"stages, {ahead_warps} warps")
                if build(label, kernel, dict(constexprs, PAGES_AHEAD=True,
                                             PAGES_PER_TILE=per_tile), ahead_warps,
                         ahead_stages, maxnreg):
                    spilled.append(label)
        if name.startswith("attend"):  # tune.py's register ceilings, as Estimate's
            for stages, registers in ((2, 128), (2, 96), (3, 128), (3, 96)):
                build(f"{name} one page per tile, {stages} stages, max registers {registers}",
                      kernel, dict(constexprs, PAGES_PER_TILE=1), warps, stages, registers)
        # the register ceilings of tune.py's sweep (estimate.max_registers): what
        # ptxas spills under each is reported, and not a failure (the sweep times the cost)
        if name.startswith("estimate"):
            for registers in (96, 80, 64):
                build(f"{name} max registers {registers}", kernel,
                      dict(constexprs, WRITE_KV=True), warps, stages, registers,
                      slot_mapping="*i64")
    # the int2 / int4 estimators (MoiraConfig.estimator): Estimate's code path and summarize
    for group, head_dim in ((GROUP, HEAD_DIM), (1, 64), (8, 128)):
        for name, kernel, constexprs, warps, stages, maxnreg in kernels(group, head_dim, 2048):
            for bits in (2, 4):
                registers = (estimate.max_registers(group, DEFAULTS, bits)
                             if name.startswith("estimate") else maxnreg)
                if (name.startswith(("estimate", "summarize"))
                        and build(f"{name} int{bits}", kernel, dict(constexprs, BITS=bits),
                                  warps, stages, registers)):
                    spilled.append(f"{name} int{bits}")
    spilled += build_cuda()
    if spilled:
        sys.exit(f"spills registers: {', '.join(spilled)}")


def build_cuda():
    """The CUDA kernels (``moira/kernels/cuda``: ``attend.cu``, ``estimate.cu``, ``select.cu``
    at every pages-per-thread and K_B it launches, G = 1, 4 and 8; the fused
    ``estimate_select.cu`` at D = 64 / 128, those G, K_B 4 / 64, P 1 / 8) built by
    NVRTC for sm_90, with ptxas' report per kernel (registers, spilled bytes; Attend's shared
    memory of the launch); nothing where no libnvrtc is found. Returns the kernels that spill."""
    if cuda_build.nvrtc_library() is None:
        print("CUDA kernels                             skipped: no libnvrtc", flush=True)
        return []
    fits = DEFAULTS.value("estimate.cuda_min_blocks_per_sm")
    builds = [(attend_cuda.SOURCE, (), ""),
              (attend_cuda.SOURCE, ("-DATTEND_TIMELINE=1",), ", timeline probe"),
              (estimate_cuda.SOURCE, estimate_cuda.build_options(fits), "")] + [
        (select_cuda.SOURCE, select_cuda.build_options(pages, ways, group), "")
        for pages in (1, 2, 4, 8, select_cuda.MAX_PAGES_PER_THREAD) for ways in select_cuda.WAYS
        for group in (1, 4, select_cuda.MAX_GROUP)
        if pages * select_cuda.MAX_THREADS <= select_cuda.max_table_pages(group, ways)] + [
        (estimate_select_cuda.SOURCE,
         (f"-DFUSED_D={head_dim}", *select_cuda.build_options(pages, ways, group)), "")
        for head_dim in (64, 128) for group in (1, 4, select_cuda.MAX_GROUP) for ways in (4, 64)
        for pages in (1, 8)  # the per-thread limit of Select's (estimate_select_cuda.applies)
        if pages * select_cuda.MAX_THREADS <= select_cuda.max_table_pages(group, ways)]
    spilled = []
    for source, options, label in builds:
        with open(cuda_build.source_path(source), "rb") as f:
            _, log = cuda_build.compile_cubin(f.read(), "90", ["--ptxas-options=-v", *options],
                                              name=source)
        # ptxas: "Compiling entry function 'NAME'", then its spills, then "Used N registers"
        for name, spill, registers in re.findall(
                r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                log, re.S):
            attend_build = re.fullmatch(r"moira_attend_d(\d+)_s(\d)", name)
            shared = (f"  shared {attend_cuda.shared_bytes(*map(int, attend_build.groups()))}"
                      if attend_build else "")
            print(f"{name} (CUDA{label})   registers {registers}  spilled bytes {spill}"
                  f"{shared}", flush=True)
            if int(spill) and "probe" not in label:  # a probe's spill is reported, not fatal
                spilled.append(f"{name} (CUDA{label})")
    return spilled


if __name__ == "__main__":
    main()
