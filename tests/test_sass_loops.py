"""scripts/sass_loops.py: the loops of a kernel's SASS and their instruction mix (text only, no GPU)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "scripts" / "sass_loops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sass(lines):
    """cuobjdump -sass's layout: an address comment, the instruction, its encoding."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {t} ;   /* 0x000000000000 */\n"
                     for i, t in enumerate(lines))


def test_loops_are_backward_branches_with_their_instruction_mix():
    body = ["LDS.128 R4, [R2]", "LDS R8, [R3+0x10]", "FFMA R10, R4, R8, R10", "FFMA R11, R5, R8, R11",
            "SHFL.BFLY PT, R12, R10, 0x1, 0x1f", "IADD3 R20, P1, R20, 0x1, RZ", "IMAD.X R21, RZ, RZ, R21, P1",
            "ISETP.NE.AND.EX P0, PT, R21, RZ, PT, P1", "@P0 BRA 0x20"]
    outer = ["MOV R1, c[0x0][0x28]", "S2R R0, SR_TID.X"] + body + ["FMUL R9, R10, R11", "@!P2 BRA 0x10", "EXIT"]
    got = _script().loops(_sass(outer))
    assert [(r["start"], r["end"]) for r in got] == [("0x20", "0xa0"), ("0x10", "0xc0")]
    inner, whole = got
    assert inner["instructions"] == 9 and inner["ffma"] == 2 and inner["ffma_share"] == round(2 / 9, 3)
    assert inner["lds"] == {"LDS": 1, "LDS.128": 1} and inner["shfl"] == 1
    assert inner["integer"] == 3 and inner["integer_64bit"] == 2          # IMAD.X and ISETP ... .EX
    assert inner["innermost"] and not whole["innermost"] and whole["instructions"] == 12


def test_a_forward_branch_is_no_loop():
    assert _script().loops(_sass(["@P0 BRA 0x30", "FFMA R1, R2, R3, R1", "NOP", "EXIT"])) == []
