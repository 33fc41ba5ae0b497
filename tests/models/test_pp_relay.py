"""Patch 0007 on CPU: vLLM's Qwen3NextModel split over two pipeline stages (two processes, gloo, vLLM's
own stage-to-stage send/recv) hands the drafter on the last stage the same hidden states, bit for bit,
as one stage does; without the patch vLLM 0.32 refuses DFlash with pipeline parallel outright
("Qwen3NextForCausalLM does not support dflash with pipeline parallelism"). Children:
tests/models/pp_relay.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backend.launcher import free_port

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _stage(model: Path, out: Path, size: int, rank: int, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.models.pp_relay", str(model), str(out), str(size),
                             str(rank), str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_stages_relay_the_drafters_hidden_states_exactly(tmp_path):
    import torch

    from backend.models import prepare_model

    model = prepare_model("tiny-qwen-hybrid")
    procs = [_stage(model, tmp_path / "one", 1, 0, free_port())]
    port = free_port()
    procs += [_stage(model, tmp_path / "two", 2, r, port) for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    one = torch.load(tmp_path / "one" / "stage0.pt")
    two = torch.load(tmp_path / "two" / "stage1.pt")
    # stage 0 captured after layers 0 and 1 and sent them with its hidden states; stage 1 added layer 2's
    assert two["sent_keys"] == ["aux_hidden_states_0", "aux_hidden_states_1", "hidden_states", "residual"]
    assert len(one["aux"]) == len(two["aux"]) == 3
    assert torch.equal(one["hidden"], two["hidden"])
    for a, b in zip(one["aux"], two["aux"], strict=True):
        assert torch.equal(a, b)
