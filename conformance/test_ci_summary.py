"""ci/gpu_summary.py, which turns the GPU runner's junit XML into the summary line the closing
notes quote and, with --models, the per-model table against llama.cpp's goldens."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def test_summary_line_and_models_table(tmp_path, capsys):
    from ci import gpu_summary
    path = tmp_path / "suite.xml"
    path.write_text(XML)
    assert gpu_summary.main([str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["conformance on GPU: 2 passed, 1 skipped, 1 failed, 0 errors"]
    assert gpu_summary.main([str(path), "--models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny-cuda"))
    for want in ("cuda", "99/100 (margin > 0.25)", "0.412", "l_out-3#0 2.00e-03", "failed/passed"):
        assert want in row, (want, row)
    assert "test_add" not in out, "kernel cases are not models"
