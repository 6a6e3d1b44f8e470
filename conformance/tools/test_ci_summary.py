"""ci/gpu_summary.py, which turns the GPU runner's junit XML into the summary line the closing
notes quote and, with --models, the per-model table against llama.cpp's goldens; and
ci/ncu_stalls.py. Both are run as their users run them, as scripts (the suite imports nothing
of ci/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "ci" / script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="conformance.test_models" name="test_teacher_forced[tiny-cuda]">
  <properties><property name="reference" value="cuda"/><property name="argmax_agreement" value="99/100 (margin &gt; 0.25)"/>
  <property name="worst_top1_delta" value="0.412"/><property name="worst_top16_nmse" value="3.10e-04"/></properties>
</testcase>
<testcase classname="conformance.test_models" name="test_activations[tiny-cuda]">
  <properties><property name="reference" value="cuda"/><property name="worst_node" value="l_out-3#0 2.00e-03"/></properties>
  <failure message="boom">boom</failure>
</testcase>
<testcase classname="conformance.test_kernels" name="test_add[1]"><properties><property name="nmse" value="0"/></properties></testcase>
<testcase classname="conformance.test_kernels" name="test_gpu_only"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


def test_summary_line_and_models_table(tmp_path):
    path = tmp_path / "suite.xml"
    path.write_text(XML)
    r = run("gpu_summary.py", path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert out == ["conformance on GPU: 2 passed, 1 skipped, 1 failed, 0 errors"]
    r = run("gpu_summary.py", path, "--models")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    row = next(line for line in out.splitlines() if line.startswith("| tiny-cuda"))
    for want in ("cuda", "99/100 (margin > 0.25)", "0.412", "l_out-3#0 2.00e-03", "failed/passed"):
        assert want in row, (want, row)
    assert "test_add" not in out, "kernel cases are not models"


def test_ncu_stalls_reads_the_pages_ncu_writes(tmp_path):
    # ci/ncu_stalls.py: the source page starts with a "Kernel Name" line before its header (the
    # first version of the parser took that line for the header and printed nothing)
    raw = tmp_path / "raw.csv"
    raw.write_text('"ID","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier",'
                   '"smsp__pcsamp_warps_issue_stalled_barrier_not_issued"\n"","","",""\n"0","470","125","3"\n')
    sass = tmp_path / "sass.csv"
    sass.write_text('"Kernel Name","matvec_split_q4_k",\n'
                    '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier",'
                    '"stall_barrier (Not Issued)"\n'
                    '"0x7f00","IDP.4A.S8.S8 R44, R36, UR5, RZ","196","196","0","0"\n'
                    '"0x7f10","BSSY B0, 0x7f40","87","0","86","9"\n'
                    '"0x7f20","LOP3.LUT R59, R25, 0xf0f0f0f, RZ, 0xc0, !PT","200","198","0","0"\n')
    r = run("ncu_stalls.py", raw, sass, 2)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "stall samples: long_scoreboard 470, barrier 125"
    assert out[1] == "483 samples over 3 instructions; the top 2:"
    assert "LOP3.LUT" in out[2] and "long_sb 198" in out[2] and "IDP.4A" in out[3] and len(out) == 4
