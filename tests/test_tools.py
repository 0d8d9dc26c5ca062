"""The developer tools that read compiler output run here without a GPU."""

import importlib.util
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One step of a consumer loop as cuobjdump prints it: S^T and dP^T issued,
# the wait for S^T (dP^T in flight), the wait for dP^T, a branch over a
# masked-only block, the dK product, dQ, and the loop's back edge.
_SASS = """
        Function : _ZN6jflash4cuda4sm9021flash_bwd_sm90_kernelI1TEEvT_
        .headerflags    @"EF_CUDA_SM90"
        /*0000*/                   MOV R1, c[0x0][0x28] ;      /* 0x00000a0000017a02 */
        /*0010*/                   HGMMA.64x80x16.F32.BF16 R192, gdesc[UR16], RZ, !UPT ;
        /*0020*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT, gsb0 ;
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0040*/                   MUFU.EX2 R3, R4 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   MUFU.EX2 R5, R6 ;
        /*0070*/              @!P0 BRA 0xa0 ;
        /*0080*/                   FMUL R7, R7, R8 ;
        /*0090*/                   STL [R1], R2 ;
        /*00a0*/                   HGMMA.64x128x16.F32.BF16 R88, R192, gdesc[UR16].tnspB, R88 ;
        /*00b0*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR24], RZ, !UPT, gsb0 ;
        /*00c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00d0*/              @!P0 BRA 0x10 ;
        /*00e0*/                   EXIT ;
"""


def test_sass_step_path_counts_one_step():
    tool = _load("sass_step_path")
    name, body = tool.function_body(_SASS, "flash_bwd_sm90_kernel")
    assert name.startswith("_ZN6jflash4cuda4sm9021flash_bwd_sm90_kernel")
    assert len(body) == 15
    (copy,) = tool.step_copies(body)
    assert (copy.first_hgmma, copy.wait_s, copy.wait_dp, copy.dk_issue) == (1, 3, 5, 10)
    # From the S^T wait to the dK issue: 7 instructions, 2 of them in the
    # block the branch skips.
    assert copy.path == 5
    assert (copy.mufu_before_dp_wait, copy.mufu_after_dp_wait) == (1, 1)
    assert (copy.local_loads, copy.local_stores) == (0, 1)


def test_sass_step_path_skips_nested_blocks_once():
    """A forward branch inside a skipped block is skipped with it, not again
    (the segment-id kernels nest them: counted twice, the path came out
    negative)."""
    tool = _load("sass_step_path")
    nested = _SASS.replace(
        "        /*0080*/                   FMUL R7, R7, R8 ;\n",
        "        /*0080*/              @P1 BRA 0xa0 ;\n")
    _, body = tool.function_body(nested, "flash_bwd_sm90_kernel")
    (copy,) = tool.step_copies(body)
    assert copy.path == 5


def test_kernel_variants_apply_to_the_tree():
    """Each patch in tools/variants/ (tools/README.md) applies to this tree, so
    that a variant a design note names can still be timed beside main."""
    import shutil
    import subprocess

    import pytest

    patches = sorted((_ROOT / "tools" / "variants").glob("*.patch"))
    if not patches:
        pytest.skip("no kernel variants waiting")
    if shutil.which("git") is None or not (_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for patch in patches:
        result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=_ROOT,
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr}"
