"""A crafted or damaged checkpoint is refused in one line, before anything is loaded: every tensor is checked
against the model being trained (not against the file's own claims), every metadata field's type and range, the
RNG states' sizes, each shard's offsets, and each tensor's bytes against the CRC-32 in the index."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from tightfit.cli import main
from tightfit.errors import UsageError
from tightfit.offload.step.loss_scale import LossScaler, load_scaler_state, scaler_state
from tightfit.train import checkpoint as ckpt
from tightfit.train.checkpoint_writer import INDEX


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, corpus):
    """A 3-step run whose checkpoint every test copies and damages."""
    out = tmp_path_factory.mktemp("good") / "run"
    args = ["--data", str(corpus), "--out-dir", str(out), "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
            "--seq-len", "32", "--micro-batch", "4", "--eval-batches", "1", "--warmup-steps", "2", "--threads", "1",
            "--steps", "3", "--offload", "none"]
    assert main(["train", *args]) == 0
    return out, args


def _craft(good_run, tmp_path, mutate=None, index_edit=None, name="run"):
    """A copy of the good run's checkpoint with its tensors changed by `mutate(dict)` (rewritten with fresh CRCs:
    only the model-side checks can catch it) and/or its index changed by `index_edit(dict)`."""
    src, args = good_run
    tensors = ckpt.read_all(src)
    info = json.loads((ckpt.latest(src) / INDEX).read_text())
    if mutate:
        mutate(tensors)
    rng = {k: tensors.pop(k) for k in list(tensors) if k.startswith("rng.")}
    out = tmp_path / name
    folder = ckpt.save_checkpoint(out / ckpt.CHECKPOINT_NAME, tensors.items(), step=info["step"],
                                  config=info["config"], signature=info["signature"], rng=rng)
    if index_edit:
        index = json.loads((folder / INDEX).read_text())
        index_edit(index)
        (folder / INDEX).write_text(json.dumps(index))
    i = args.index("--out-dir")
    return folder, args[: i + 1] + [str(out)] + args[i + 2:]


def _refused(args, capsys, *needles, extra=()):
    capsys.readouterr()
    assert main(["train", *args, "--steps", "5", "--resume", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("offload", ["none", "host"])
def test_moment_of_the_wrong_shape(good_run, tmp_path, capsys, offload):
    """Was a SIGSEGV with --offload none."""
    def mutate(t):
        t["optim.blocks.0.attn.q_proj.weight.exp_avg"] = torch.zeros(3)
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "optim.blocks.0.attn.q_proj.weight.exp_avg", "[3]", extra=["--offload", offload])


def test_scalar_weight_is_not_broadcast(good_run, tmp_path, capsys):
    def mutate(t):
        t["model.tok_emb.weight"] = torch.tensor(0.5)
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "different model", "tok_emb.weight")


def test_weights_in_another_dtype(good_run, tmp_path, capsys):
    def mutate(t):
        t["model.ln_f.weight"] = t["model.ln_f.weight"].half()
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "model.ln_f.weight", "float16")


def test_tensor_the_model_has_no_place_for(good_run, tmp_path, capsys):
    def mutate(t):
        t["model.extra.weight"] = torch.zeros(2)
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "different model", "model.extra.weight")


def test_optimizer_state_missing_a_part(good_run, tmp_path, capsys):
    def mutate(t):
        del t["optim.ln_f.weight.step"]
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "optim.ln_f.weight.step")


@pytest.mark.parametrize("step", [-5, "3", 2.5, True, None])
def test_step_of_the_wrong_type_or_range(good_run, tmp_path, capsys, step):
    _, args = _craft(good_run, tmp_path, index_edit=lambda i: i.update(step=step))
    _refused(args, capsys, "step", INDEX)


@pytest.mark.parametrize("scaler", [{"scale": -1.0, "growth_tracker": 0}, {"scale": float("nan"), "growth_tracker": 0},
                                    {"scale": 1.0}, "big"])
def test_bad_loss_scaler_state(good_run, tmp_path, capsys, scaler):
    _, args = _craft(good_run, tmp_path, index_edit=lambda i: i.update(loss_scaler=scaler))
    _refused(args, capsys, "loss_scaler")


def test_missing_rng_state(good_run, tmp_path, capsys):
    _, args = _craft(good_run, tmp_path, mutate=lambda t: t.pop("rng.torch"))
    _refused(args, capsys, "rng.torch")


def test_rng_state_of_the_wrong_size(good_run, tmp_path, capsys):
    def mutate(t):
        t["rng.data"] = t["rng.data"][:100].clone()
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "rng.data", "[100]")


def test_bit_rot_fails_the_checksum(good_run, tmp_path, capsys):
    folder, args = _craft(good_run, tmp_path)
    shard = folder / "blocks.1.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x10  # one bit of the last tensor's bytes
    shard.write_bytes(bytes(raw))
    _refused(args, capsys, "blocks.1.safetensors", "checksum")


def test_shard_header_disagrees_with_the_index(good_run, tmp_path, capsys):
    def edit(index):
        index["tensors"]["model.ln_f.weight"]["shape"] = [16, 2]
    _, args = _craft(good_run, tmp_path, index_edit=edit)
    _refused(args, capsys, "model.ln_f.weight", "index")


def _rewrite_header(path, change):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def test_overlapping_offsets_in_a_shard(good_run, tmp_path, capsys):
    folder, args = _craft(good_run, tmp_path)

    def overlap(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[names[0]], h[names[1]]
        size = a["data_offsets"][1] - a["data_offsets"][0]
        if b["data_offsets"][1] - b["data_offsets"][0] == size:  # b claims a's bytes
            b["data_offsets"] = list(a["data_offsets"])
        else:
            a["data_offsets"] = [a["data_offsets"][0] + 4, a["data_offsets"][1] + 4]
    _rewrite_header(folder / "root.safetensors", overlap)
    _refused(args, capsys, "root.safetensors")


def test_index_that_is_not_json_and_a_missing_shard(good_run, tmp_path, capsys):
    folder, args = _craft(good_run, tmp_path)
    (folder / "blocks.0.safetensors").unlink()
    _refused(args, capsys, "blocks.0.safetensors", "missing")
    (folder / INDEX).write_text("{not json")
    _refused(args, capsys, INDEX)


def test_a_refused_checkpoint_writes_nothing_to_a_tier(good_run, tmp_path, capsys):
    def mutate(t):
        t["model.tok_emb.weight"] = torch.tensor(0.5)
    _, args = _craft(good_run, tmp_path, mutate)
    swap = tmp_path / "swap"
    _refused(args, capsys, "different model", extra=["--offload", "nvme", "--nvme", str(swap)])
    assert not swap.exists() or not any(swap.rglob("*.safetensors"))


def test_loss_scaler_state_round_trips_between_scalers(tmp_path):
    """fp16 runs: the scaler's state is in the checkpoint, and either scaler (tightfit's on the offload path,
    torch's GradScaler on the plain one) restores it exactly."""
    src = LossScaler()
    src.scale_value, src._clean_steps = 1024.0, 17
    rng = ckpt.capture_rng(torch.Generator())
    folder = ckpt.save_checkpoint(tmp_path / "c", [("model.w", torch.ones(2))], step=4, config={}, signature="",
                                  rng=rng, loss_scaler=scaler_state(src))
    loaded = ckpt.load_checkpoint(folder)
    assert loaded.loss_scaler == {"scale": 1024.0, "growth_tracker": 17}
    dst = LossScaler()
    load_scaler_state(dst, loaded.loss_scaler)
    assert (dst.scale_value, dst._clean_steps) == (1024.0, 17)
    gs = torch.amp.GradScaler("cpu")
    load_scaler_state(gs, loaded.loss_scaler)
    assert scaler_state(gs) == {"scale": 1024.0, "growth_tracker": 17}
    assert scaler_state(None) is None


def test_checksums_are_verified_on_every_read(tmp_path):
    rng = ckpt.capture_rng(torch.Generator())
    folder = ckpt.save_checkpoint(tmp_path / "c", [("model.w", torch.arange(8.0))], step=1, config={},
                                  signature="", rng=rng)
    shard = folder / "root.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    c = ckpt.load_checkpoint(folder)
    with pytest.raises(UsageError, match="fails its checksum"):
        c.get("model.w")


def test_an_invalid_rng_state_is_refused_before_anything_is_loaded(good_run, tmp_path, capsys):
    """The right size and a valid checksum, but not a state torch accepts: it failed with a RuntimeError after the
    tiers were filled (issue 27); now one line, before."""
    def mutate(t):
        t["rng.data"] = torch.full_like(t["rng.data"], 255)
    _, args = _craft(good_run, tmp_path, mutate)
    _refused(args, capsys, "random-number state is not valid")


def test_a_non_finite_tensor_with_a_valid_checksum_is_refused(good_run, tmp_path, capsys):
    """tightfit never commits a non-finite tensor; a crafted file with NaNs and a matching CRC loaded in silence and
    was then called the last good checkpoint (issue 27)."""
    import zlib

    folder, args = _craft(good_run, tmp_path)
    index = json.loads((folder / INDEX).read_text())
    key = "model.ln_f.weight"
    shard = folder / index["weight_map"][key] if "weight_map" in index else folder / "root.safetensors"
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    lo, hi = header[key]["data_offsets"]
    nan = torch.full(((hi - lo) // 4,), float("nan"))
    raw[8 + n + lo:8 + n + hi] = nan.numpy().tobytes()
    shard.write_bytes(bytes(raw))
    index["tensors"][key]["crc32"] = zlib.crc32(nan.numpy().tobytes())
    (folder / INDEX).write_text(json.dumps(index))
    _refused(args, capsys, key, "NaN or infinite")


def test_an_index_nested_too_deep_or_a_numeric_shard_name_is_one_line(good_run, tmp_path, capsys):
    """json.loads raises RecursionError, not ValueError, at depth; a weight_map value that is a number failed in
    sorted() with a TypeError (issue 27)."""
    folder, args = _craft(good_run, tmp_path)
    index = json.loads((folder / INDEX).read_text())
    (folder / INDEX).write_text("[" * 200_000 + "]" * 200_000)
    _refused(args, capsys, INDEX, "nested too deeply")
    index["weight_map"]["model.ln_f.weight"] = 7
    (folder / INDEX).write_text(json.dumps(index))
    _refused(args, capsys, INDEX, "weight_map")


def test_a_shard_header_nested_too_deep_is_one_line(good_run, tmp_path, capsys):
    folder, args = _craft(good_run, tmp_path)
    shard = folder / "root.safetensors"
    body = ("[" * 100_000 + "]" * 100_000).encode()
    shard.write_bytes(struct.pack("<Q", len(body)) + body)
    _refused(args, capsys, "root.safetensors")
