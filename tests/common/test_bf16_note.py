"""The run-time note for bf16 compute on a CPU without bf16 instructions: flags read from
a cpuinfo file (x86 `flags`, Arm `Features`), the note only where it applies, and the
`run` command printing it before anything starts."""

from __future__ import annotations

from pathlib import Path

from posttrain.common.process import bf16_note, cpu_has_bf16

X86_NO_BF16 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2 avx512f\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def _info(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    return f


def test_flags_are_read_from_cpuinfo(tmp_path):
    assert cpu_has_bf16(_info(tmp_path, X86_NO_BF16)) is False
    assert cpu_has_bf16(_info(tmp_path, X86_AMX)) is True
    assert cpu_has_bf16(_info(tmp_path, ARM_BF16)) is True
    assert cpu_has_bf16(tmp_path / "missing") is None
    assert cpu_has_bf16(_info(tmp_path, "processor\t: 0\n")) is None


def test_note_only_for_bf16_on_a_cpu_without_it(tmp_path):
    plain = _info(tmp_path, X86_NO_BF16)
    note = bf16_note("cpu", "bfloat16", plain)
    assert note is not None and "--set model.dtype=float32" in note
    assert bf16_note("cpu", "float32", plain) is None
    assert bf16_note("cuda", "bfloat16", plain) is None
    assert bf16_note("cpu", "bfloat16", _info(tmp_path, X86_AMX)) is None
    assert bf16_note("cpu", "bfloat16", tmp_path / "missing") is None
