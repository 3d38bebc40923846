"""The fused pass's kernels compiled for an NVIDIA GPU, their global loads and stores counted.

Compiles ``_read_kernel`` (without the replica checksum, with it, with its keyed sums too) and
``_scale_kernel``
(``distscaler/_triton/kernels.py``; each with its branches for 16-byte aligned blocks, which read
full tiles in vectors, and for the others) for compute capability ``--arch`` (default: this
machine's GPU, else 90, an H100), and prints the PTX's ``ld.global``/``st.global`` instructions
by kind (``.v4.b32`` moves 16 bytes at a time), the registers per thread and bytes spilled (the
cubin, through the ``cuobjdump`` Triton bundles), and the warps per SM those registers allow
(65,536 registers and at most 64 warps per SM, as on sm_80 to sm_100; whole blocks of
``num_warps``). Needs no GPU: Triton's compiler and its bundled ``ptxas`` run on the CPU.

    python launch/kernel_ptx.py                 # this GPU's architecture, or sm_90
    python launch/kernel_ptx.py --arch 100      # a B200
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=None,
                        help="compute capability as an int (90: H100); default: this GPU's, or 90")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's notice, silenced
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import triton

    from distscaler._triton import diagnostics as diag
    from distscaler._triton.tables import KEY_ROW_WORDS

    if not diag.can_compile_for_a_gpu():
        sys.exit("needs Triton >= 3.3 with its CUDA backend (pip install triton)")
    arch = args.arch
    if arch is None:
        major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
        arch = 10 * major + minor
    cfg = diag.CONFIG
    print(f"Triton {triton.__version__}, sm_{arch}, BLOCK={cfg['BLOCK']}, "
          f"num_warps={cfg['num_warps']}, INNER={cfg['INNER']}")  # fmt: skip
    print("| kernel | registers | spilled bytes | warps per SM | global loads and stores |")
    print("|---|---|---|---|---|")
    cases = [("_read_kernel", {"NORM": 2, "MOMENTS": m, "BLOCK": cfg["BLOCK"] // (1 + k),
                               "INNER": cfg["INNER"] * (1 + k), "DYNAMIC": False,
                               "UNSCALED": True, "KEYED": k, "ROW": KEY_ROW_WORDS},
              f"moments={m}, keyed={k}" + (", half tiles" if k else ""))
             for m, k in ((False, False), (True, False), (True, True))]  # fmt: skip
    cases.append(("_scale_kernel", {"DIVIDE": True, "ROUND": True, "BLOCK": cfg["BLOCK"]}, "div"))
    for name, consts, what in cases:
        compiled = diag.compile_for_a_gpu(name, consts, arch)
        counts = diag.ptx_accesses(compiled)
        res = diag.registers(compiled)
        regs = res.get("REG")
        shown = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        print(f"| {name} ({what}) | {regs if regs else '?'} | {res.get('STACK', '?')} | "
              f"{warps_per_sm(regs, cfg['num_warps'])} | {shown} |")

def warps_per_sm(regs: int | None, num_warps: int) -> str:
    """Resident warps per SM at ``regs`` registers per thread (allocated in units of 8 per
    thread, 65,536 per SM, at most 64 warps), in whole blocks of ``num_warps``."""
    if not regs:
        return "?"
    per_warp = 32 * (-(-regs // 8) * 8)
    warps = min(64, 65536 // per_warp)
    return str(warps // num_warps * num_warps)

if __name__ == "__main__":
    main()
