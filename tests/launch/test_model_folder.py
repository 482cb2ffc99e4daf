"""A Hugging Face Hub id instead of a model folder fails at once, in one line that says what to do, and never
reaches transformers (which would try the network)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.engine.model.arch import check_model_folder

HUB_ID = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.slow
@pytest.mark.parametrize("module", ["pd_cluster.launch.worker", "pd_cluster.launch.serve"])
def test_a_hub_id_fails_in_one_line(module):
    out = subprocess.run([sys.executable, "-m", module, "--model", HUB_ID, "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    errors = [ln for ln in out.stderr.splitlines() if ": error: " in ln]  # argparse may print its usage first
    assert len(errors) == 1 and errors[0] == out.stderr.splitlines()[-1], out.stderr
    assert f"huggingface-cli download {HUB_ID} --local-dir DIR" in errors[0] and "--model DIR" in errors[0]
    assert "Traceback" not in out.stderr and "huggingface.co" not in out.stderr


def test_the_offline_api_refuses_a_hub_id_before_loading(tmp_path):
    from pd_cluster.engine import LLM

    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        LLM(HUB_ID)
    with pytest.raises(FileNotFoundError, match="pass a Hugging Face model folder"):
        check_model_folder(tmp_path / "missing")
    assert check_model_folder(tmp_path) == tmp_path
