"""The code sandbox bounds the host memory a program can take: its output is read as it
comes and cut at `max_output_bytes` without holding the rest (1 GiB on stderr took the
reward service from 345 MB to 2.4 GB when output was read whole, then cut), and its
/tmp and work dir are tmpfs of `tmpfs_mb` each (unsized, a program put 1 GiB in host
RAM in under a second), the rest of the root read-only. Sizes here stay small (256 MiB
of output, 64 MiB of tmpfs) so the tests take seconds."""

from __future__ import annotations

import shutil
import tracemalloc

import pytest

from posttrain.rewards.sandbox import BwrapSandbox, Limits, NoSandbox

FLOOD = """
import sys
block = b"x" * 2**20
for _ in range(256):  # 256 MiB on {stream}
    sys.{stream}.buffer.write(block)
sys.{stream}.buffer.flush()
print("done", file=sys.{other})
"""

LIMITS = Limits(wall_s=60, cpu_s=30, memory_mb=256, max_output_bytes=65536)


def _peak_mib(run) -> tuple[object, float]:
    tracemalloc.start()
    try:
        got = run()
        return got, tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def bwrap():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return BwrapSandbox()


@pytest.mark.filterwarnings("ignore:code reward runs WITHOUT a sandbox")
@pytest.mark.parametrize("stream,other", [("stderr", "stdout"), ("stdout", "stderr")])
def test_a_flood_of_output_is_cut_without_being_held(stream, other):
    code = FLOOD.format(stream=stream, other=other)
    got, peak = _peak_mib(lambda: NoSandbox().run(code, None, LIMITS))
    assert got.returncode == 0 and not got.timed_out, got.stderr[-300:]
    assert got.truncated
    assert len(getattr(got, stream)) == 65536 and set(getattr(got, stream)) == {"x"}
    assert getattr(got, other) == "done\n"  # the other stream whole
    assert peak < 8, f"{peak:.1f} MiB held for 256 MiB of output"  # read whole: >= 256


def test_a_flood_in_bwrap_is_cut_without_being_held(bwrap):
    got, peak = _peak_mib(
        lambda: bwrap.run(FLOOD.format(stream="stderr", other="stdout"), None, LIMITS)
    )
    assert got.returncode == 0 and got.truncated and got.stdout == "done\n", got.stderr[-300:]
    assert peak < 8, f"{peak:.1f} MiB held for 256 MiB of output"


FILL = """
import os
written = 0
try:
    for i in range(64):  # 8 MiB files (the per-file limit is 16 MiB): up to 512 MiB
        with open(os.path.join({folder!r}, f"f{{i}}"), "wb") as f:
            f.write(b"x" * 2**23)
        written += 2**23
except OSError as e:
    print("stopped", e.errno, written // 2**20)
else:
    print("wrote", written // 2**20)
"""


@pytest.mark.parametrize("folder", ["/tmp", "/work"])
def test_the_tmpfs_is_sized(bwrap, folder):
    got = bwrap.run(FILL.format(folder=folder), None, Limits(wall_s=60, tmpfs_mb=64))
    assert got.returncode == 0, got.stderr[-300:]
    word, errno_, mib = got.stdout.split()
    assert word == "stopped" and errno_ == "28" and int(mib) <= 64, got.stdout  # ENOSPC


def test_the_root_is_read_only(bwrap):
    got = bwrap.run("open('/x', 'w')", None, Limits(wall_s=30))
    assert got.returncode == 1 and "Read-only file system" in got.stderr, got.stderr
