"""`tightfit env` reports torch, devices, host RAM and free disk, as text and as JSON."""

from __future__ import annotations

import json

import psutil
import torch

from tightfit.cli import main


def test_env_json_matches_the_machine(tmp_path, capsys):
    assert main(["env", "--json", "--nvme", str(tmp_path / "swap")]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["torch"] == torch.__version__
    assert 0 < env["host_ram_available"] <= env["host_ram_total"] == psutil.virtual_memory().total
    assert env["swap_folder_free"] > 0 and env["swap_folder"].endswith("swap")
    assert len(env["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_env_text(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "host:" in out and "disk:" in out
