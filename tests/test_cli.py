import json
import subprocess
import sys

import pytest

from fedlora.cli import main


def test_describe_reports_real_shapes_and_upload_sizes(capsys):
    assert main(["describe", "--model", "vit-tiny", "--rank", "4", "--sketch-dim", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapted_layers"] == 12 and report["layer_shapes"] == ["B 192x4, A 4x192"]
    uploads = {row["strategy"].split(" ")[0]: row for row in report["mechanisms"]}
    assert uploads["ffa-lora"]["upload_values"] == 12 * 192 * 4  # dense B
    assert uploads["sgmm-ffa-lora"]["upload_values"] == 12 * 16 * 4  # R B: b x r per layer
    assert uploads["sgmv-ffa-lora"]["upload_values"] == 12 * 64  # h = b r
    # the vectorized sketch costs r times the matrix sketch (paper, Section 2)
    assert uploads["sgmv-ffa-lora"]["sketch_multiply_adds"] == 4 * uploads["sgmm-ffa-lora"]["sketch_multiply_adds"]


@pytest.mark.parametrize("argv, message", [
    (["describe", "--rank", "0"], "--rank: must be at least 1"),
    (["describe", "--model", "vit-tiny", "--sketch-dim", "500"], "must lie in [1, 192]"),
    (["describe", "--model", "vit-huge"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_error_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("fedlora: error:")


def test_console_script_exits_2_without_traceback():
    result = subprocess.run([sys.executable, "-m", "fedlora.cli", "describe", "--rank", "-1"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
