"""The run's last checkpoint takes the swap files' place ([Note: the last save takes the swap's place] in
offload/memory_model.py): each range copied from a swap file is released from it, so a disk that holds the swap
and one checkpoint's worth less than its NVMe states still takes the run's checkpoint (issue 26: the 3.4B Llama's
38 GiB checkpoint beside its 48 GiB of swap on a 78 GB disk)."""

import json
from pathlib import Path

import pytest
import torch

import tightfit.train.checkpoint_swap as cs
import tightfit.train.checkpoint_writer as cw
from tightfit.cli import main
from tightfit.errors import UsageError
from tightfit.train import checkpoint as ckpt
from tightfit.utils.sizes import parse_size


def _allocated(*folders: Path) -> int:
    """Bytes the disk holds for every file under `folders` (blocks, not sizes: a punched range holds none)."""
    return sum(p.stat().st_blocks * 512 for f in folders if f.exists() for p in f.rglob("*") if p.is_file())


def test_the_memory_model_counts_one_unit_held_twice():
    """A unit adds its checkpoint bytes and gives back its swap file: the last save needs less than a checkpoint
    by what every unit but the largest gives back, counting no more than it adds."""
    from tightfit.offload import memory_model as mm
    from tightfit.offload.placement import Placement, Tier, UnitPlacement

    units = [mm.UnitSize("root", 100, 100), mm.UnitSize("blocks.0", 50, 50), mm.UnitSize("blocks.1", 50, 50)]
    nvme = Placement.everywhere(Tier.NVME)
    # fp32 on NVMe: params (the master) 4 B, grads 4, moments 8 in the swap; 12 B a parameter in the checkpoint.
    assert mm.handed_over(units, nvme, 4) == 12 * 100
    host = nvme.with_units(root=UnitPlacement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.HOST))
    assert mm.handed_over(units, host, 4) == 12 * 50  # the root gives nothing back
    moments = Placement.everywhere(Tier.HOST).with_units(
        **{u.name: UnitPlacement(Tier.HOST, Tier.HOST, Tier.HOST, Tier.NVME) for u in units})
    assert mm.handed_over(units, moments, 2) == 8 * 100  # the moments only: 8 B of the 12


def test_the_room_check_counts_the_last_saves_hand_over_only_for_the_last(tmp_path, monkeypatch):
    per, frees = 1000, 600
    monkeypatch.setattr(cw, "free_bytes", lambda path: 500)
    assert cw.check_room(tmp_path, per, keep=1, saves=1, last_frees=frees) == (400, 500)
    with pytest.raises(Exception, match="needs 1000 B but"):
        cw.check_room(tmp_path, per, keep=1, saves=1)
    # Two saves: the first is written whole beside nothing, the last beside the first less what it takes over.
    monkeypatch.setattr(cw, "free_bytes", lambda path: 10_000)
    assert cw.check_room(tmp_path, per, keep=1, saves=2, last_frees=frees)[0] == 1400
    assert cw.check_room(tmp_path, per, keep=1, saves=3, last_frees=frees)[0] == 2000  # the middle one's peak
    assert cw.check_room(tmp_path, per, keep=1, last_frees=frees)[0] == 2000  # saves unknown: no credit


def test_the_last_save_fits_a_disk_that_only_its_hand_over_makes_room_on(tiny_args, tmp_path, capsys, monkeypatch):
    """A disk sized for the swap and 60% of a checkpoint: the run is accepted, its disk never holds more than that
    (swap files and checkpoint counted in blocks as each unit reaches the checkpoint), and the checkpoint holds the
    same tensors as a run of plain PyTorch. With a save before the last (`--save-interval 1`), which is a copy
    beside the whole swap, the same disk is refused."""
    i = tiny_args.index("--out-dir")

    def at(name, steps="4"):
        return tiny_args[: i + 1] + [str(tmp_path / name)] + tiny_args[i + 2:] + ["--steps", steps]

    swap, run = tmp_path / "swap", tmp_path / "nvme"
    assert main(["train", *at("plain"), "--offload", "none"]) == 0
    assert main(["train", *at("full"), "--offload", "nvme", "--nvme", str(tmp_path / "swap-full")]) == 0
    per = _allocated(ckpt.latest(tmp_path / "full"))
    out = capsys.readouterr().out
    assert "and the last save takes " in out, out
    # The swap's bytes on the disk: the plan's prediction the run printed (its files are gone at the end), and
    # headroom for the files' headers.
    nvme = out.split("nvme ")[1].split("/")[0]
    swap_bytes = parse_size(nvme.replace(" ", "")) + (64 << 10)
    cap = swap_bytes + int(0.6 * per)
    used = []

    def free(path):
        now = _allocated(swap, run)
        used.append(now)
        return max(0, cap - now)

    monkeypatch.setattr(cw, "free_bytes", free)
    for name in ("put", "put_copy"):  # metered after each unit reaches the checkpoint, before its swap file goes
        real = getattr(cw.CheckpointWriter, name)

        def metered(self, *a, _real=real):
            _real(self, *a)
            used.append(_allocated(swap, run))

        monkeypatch.setattr(cw.CheckpointWriter, name, metered)
    assert main(["train", *at("nvme"), "--offload", "nvme", "--nvme", str(swap)]) == 0, capsys.readouterr().err
    assert max(used) <= cap, (max(used), cap, per)
    assert max(used) > swap_bytes - (128 << 10)  # the meter saw the swap allocated
    ref, got = ckpt.read_all(tmp_path / "plain"), ckpt.read_all(run)
    assert ref.keys() == got.keys()
    for k in ref:
        if not k.startswith("rng."):  # planning an offloaded run draws random numbers (a trial model)
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=k)
    assert not swap.exists() or not any(swap.rglob("*.safetensors"))
    capsys.readouterr()
    assert main(["train", *at("again", "2"), "--offload", "nvme", "--nvme", str(swap), "--save-interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "2 checkpoints of this model" in err and len(err.splitlines()) == 1, err


def test_units_read_through_memory_hand_their_swap_over_too(tmp_path, monkeypatch):
    """A unit whose master is in host memory and whose params and moments are on NVMe is read through memory: its
    swap file goes once the writer has its pieces, before the next unit is read; the checkpoint equals plain
    PyTorch's. A unit with nothing on NVMe has nothing to give back."""
    from offload_helpers import tier_placements, tiny_gpt, train

    from tightfit.offload.step.engine import find_engine
    from tightfit.offload.tiers.stores import DiskStore

    _, plain, plain_opt = train(tiny_gpt, steps=3)
    _, model, opt = train(tiny_gpt, tier_placements(tmp_path)["mixed"], steps=3)
    engine = find_engine(model)
    swap = tmp_path / "swap"
    assert len(list(swap.rglob("*.safetensors"))) == len(engine.units) - 1  # the root is on the host
    events = []
    real_drop, real_put = DiskStore.drop, cw.CheckpointWriter.put
    monkeypatch.setattr(DiskStore, "drop", lambda self, unit: events.append(("drop", unit)) or real_drop(self, unit))
    monkeypatch.setattr(cw.CheckpointWriter, "put", lambda self, g, items: events.append(("put", g))
                        or real_put(self, g, items))
    fields = {"step": 3, "config": {}, "signature": "", "rng": ckpt.capture_rng(torch.Generator())}
    ckpt.start_save(tmp_path / "got", cs.state_groups(model, opt, hand_over=True), **fields).wait()
    engine.close()
    assert not any(swap.rglob("*.safetensors"))
    blocks = [u for u in engine.units if u != "root"]
    for i, unit in enumerate(blocks):  # each block: its pieces, then its file, then the next block's pieces
        last_put = max(j for j, e in enumerate(events) if e == ("put", unit))
        assert events[last_put + 1] == ("drop", unit), events
        if i + 1 < len(blocks):
            assert events.index(("put", blocks[i + 1])) > last_put + 1
    assert ("drop", "root") not in events
    ckpt.start_save(tmp_path / "ref", cs.state_groups(plain, plain_opt), **fields).wait()
    ref, got = ckpt.read_all(tmp_path / "ref"), ckpt.read_all(tmp_path / "got")
    assert ref.keys() == got.keys()
    for k in ref:
        if not k.startswith("rng."):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=k)


def test_the_summary_reports_the_engines_peaks_as_they_stood_before_the_hand_over(tiny_args, tmp_path):
    """The last save closes the engine, whose closed stores hold no bytes: the summary and the plan's comparison
    report the peaks the run reached, the same as a run that saves nothing and closes the engine after them."""
    i = tiny_args.index("--out-dir")

    def summary(name, *extra):
        args = tiny_args[: i + 1] + [str(tmp_path / name)] + tiny_args[i + 2:]
        assert main(["train", *args, "--steps", "2", "--offload", "host", *extra]) == 0
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return (next(x for x in lines if x.get("kind") == "summary")["peak_memory"],
                next(x for x in lines if x.get("kind") == "plan_vs_measured")["measured"])

    saved, unsaved = summary("saved"), summary("unsaved", "--keep-checkpoints", "0")
    for key in ("host", "device"):
        assert saved[0][key] == unsaved[0][key] > 0, (key, saved, unsaved)
    assert saved[1]["host_peak"] == unsaved[1]["host_peak"] > 0


def test_an_export_comes_before_the_hand_over_and_refuses_a_non_finite_weight(tiny_args, tmp_path, capsys,
                                                                               monkeypatch, llama_folder):
    """--export-hf writes its folder from the states before the last save takes the swap over (so the room check
    counts the hand-over with it too); a NaN weight stops the run as the save would have, with no export."""
    transformers = pytest.importorskip("transformers")
    from tightfit.train import memory

    i = tiny_args.index("--out-dir")

    def run(name, *extra):
        args = tiny_args[: i + 1] + [str(tmp_path / name)] + tiny_args[i + 2:]
        return main(["train", *args, "--steps", "2", "--model", f"hf:{llama_folder}", "--offload", "nvme",
                     "--nvme", str(tmp_path / "swap"), "--export-hf", str(tmp_path / f"{name}-hf"), *extra])

    assert run("good") == 0
    assert "and the last save takes " in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "good-hf")
    saved = ckpt.read_all(tmp_path / "good")
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), saved[f"model.{name}"]), name

    real = memory.OffloadMemory.export_state

    def poisoned(self):
        for key, t in real(self):
            yield key, (t.fill_(float("nan")) if key.endswith("layers.1.mlp.up_proj.weight") else t)

    monkeypatch.setattr(memory.OffloadMemory, "export_state", poisoned)
    capsys.readouterr()  # transformers' loading bar
    assert run("bad") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.1.mlp.up_proj.weight" in err and "nan" in err, err
    assert not (tmp_path / "bad-hf").exists() and ckpt.latest(tmp_path / "bad") is None
    # An export that fails otherwise (a full disk there) still leaves the run's last checkpoint, then says why.
    monkeypatch.setattr(memory.OffloadMemory, "export_state", real)
    from tightfit.models import hf_save

    def full(*a, **k):
        raise UsageError("--export-hf: no space left there")

    monkeypatch.setattr(hf_save, "save_hf_model", full)
    assert run("full") == 2
    assert "--export-hf: no space left there" in capsys.readouterr().err
    assert ckpt.latest(tmp_path / "full").name == "step-00000002"


def test_tightfit_plan_says_what_disk_the_end_of_the_run_needs(tmp_path, capsys):
    """`tightfit plan` with NVMe states names the swap, a checkpoint, and what the last save adds beyond the swap:
    the same rule the trainer's room check uses (`memory_model.handed_over`), before anything is allocated."""
    args = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--micro-batch", "4"]
    assert main(["plan", *args, "--offload", "nvme", "--nvme", str(tmp_path / "swap")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("disk: "))
    assert "the swap " in line and "a checkpoint about " in line and "beyond the swap" in line, line
    need = parse_size(line.split("needs ")[1].split(" beyond")[0].replace(" ", ""))
    checkpoint = parse_size(line.split("a checkpoint about ")[1].split(",")[0].replace(" ", ""))
    assert 0 < need < checkpoint / 2  # every unit's states are on NVMe: one unit held twice
    assert main(["plan", *args, "--offload", "nvme", "--nvme", str(tmp_path / "swap"), "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["disk"]
    assert disk["swap"] > 0 and disk["checkpoint"] > 2 * disk["last_save_beyond_swap"] > 0
    assert main(["plan", *args, "--offload", "host"]) == 0
    assert "disk: " not in capsys.readouterr().out
