"""Parts of the code-generation report (``fmoe2/codegen.py``) that read a disassembly, tested on listings written
here (the compiling tests are in ``test_codegen.py``)."""
from fmoe2.codegen import longest_loop_opcodes

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0040*/              @!P0 BRA 0x20 ;
        /*0050*/                   FMUL R3, R3, R3 ;
        /*0060*/                   FMUL R3, R3, R3 ;
        /*0070*/                   FMUL R3, R3, R3 ;
        /*0080*/               @P1 BRA 0x50 ;
        /*0090*/                   FMUL R3, R3, R3 ;
        /*00a0*/                   FMUL R3, R3, R3 ;
        /*00b0*/                   BRA 0xc0 ;
        /*00c0*/                   EXIT ;
"""


def test_the_longest_loop_is_counted_once_by_opcode_without_predicates():
    # Two loops: 0x20-0x40 (3 instructions) and 0x50-0x80 (4); the forward branch at 0xb0 is none.
    assert longest_loop_opcodes(LISTING) == {"FMUL": 3, "BRA": 1}
    assert longest_loop_opcodes(LISTING.replace("@P1 BRA 0x50", "@P1 BRA 0x20")) == {
        "FMUL": 3, "BRA": 2, "HMMA.16816.F32.BF16": 1, "LDSM.16.M88.4": 1}
    assert longest_loop_opcodes("/*0000*/ EXIT ;") == {}
