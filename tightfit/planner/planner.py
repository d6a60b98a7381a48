"""`make_plan`: model + config (+ hardware) -> Plan. The one function the CLI and the trainer call.

Why here and not in `search.py`: this is where the config's words become the planner's numbers (device, precision,
budgets, the --offload mode) and where the profile, the search and the trace are put together; the search
itself knows nothing about flags.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.placement import State, Tier
from tightfit.planner.budgets import budgets_from, device_ok, violations
from tightfit.planner.costs import TrainShape
from tightfit.planner.hardware import HardwareProfile, current
from tightfit.planner.model_profile import DTYPE_BYTES, profile_model
from tightfit.planner.named_profiles import PROFILES
from tightfit.planner.naming import CLI, Naming
from tightfit.planner.plan import Plan
from tightfit.planner.search import fixed, search
from tightfit.utils.sizes import format_size


def make_plan(model: nn.Module, cfg, hardware: HardwareProfile | None = None, names: Naming = CLI,
              what_if: bool = False, autocast: bool = True, averaging=None, plain_if_still: bool = False) -> Plan:
    """Plan where every state of `model` (which may live on the meta device) goes, and predict the result.

    `hardware`: a profile to plan for (tests, what-ifs); None reads this machine's cached profile (probing it
    once if there is none) with capacities re-read now. `what_if`: `hardware` describes another machine (a
    `--hardware` file or named profile): nothing of this machine is read into it. `names`: how messages name the
    settings (CLI flags, or the keyword arguments of `tightfit.plan`). `autocast`: the loop runs a bf16/fp16
    forward under `torch.autocast`, as `tightfit train` and the Hugging Face Trainer do (the trace then makes its
    casts: planner/autocast_trace.py); False for a loop that runs the compute dtype as given. `averaging`: the plan
    is one rank's of replicas that average their gradients over a group (`tightfit.parallel.links.Averaging`),
    priced in its step. `plain_if_still`: the loop can run plain PyTorch instead of the engine (`tightfit train` in
    one process): under --offload auto a placement that moves nothing is then planned as plain PyTorch
    ([Note: nothing to move, no engine]). Raises UsageError when no placement fits.
    """
    from tightfit.config import parse_nvme, precision_name

    nvme_dir = parse_nvme(cfg.memory.nvme, names.of("nvme"))[0] if cfg.memory.nvme else None
    given = hardware is not None
    if hardware is None:
        from tightfit.planner.probe import load_or_probe

        hardware = load_or_probe(nvme_dir)
    elif nvme_dir and hardware.nvme_free == 0 and hardware.measured_at and not what_if:
        hardware = current(hardware, nvme_dir)
    cuda = _computes_on_cuda(cfg.train.device, hardware, given, what_if, names)
    dtype = precision_name(cfg, "cuda" if cuda else "cpu")
    budgets = budgets_from(cfg.memory, hardware, names)
    profile = profile_model(model, cfg.train.micro_batch, cfg.train.seq_len, dtype, cuda, autocast=autocast)
    shape = TrainShape(compute_bytes=DTYPE_BYTES[dtype], grad_accum=cfg.train.grad_accum,
                       tokens_per_micro=cfg.train.micro_batch * cfg.train.seq_len,
                       grad_clip=cfg.optim.grad_clip > 0, checkpoints=cfg.train.keep_checkpoints > 0,
                       engine=cfg.memory.offload != "none")
    if averaging is not None and averaging.ranks > 1:
        shape = replace(shape, ranks=averaging.ranks, allreduce_bw=averaging.bus_bw,
                        allreduce_on_link=averaging.on_link, allreduce_source=averaging.source,
                        node_ranks=averaging.node_ranks)
    elsewhere = sorted(averaging.stepped_elsewhere) if averaging is not None else []
    grads_elsewhere = bool(elsewhere) and averaging.grads_elsewhere
    exchanged = sorted(averaging.exchanged) if averaging is not None else []
    if elsewhere:  # [Note: optimizer states sharded by unit] in parallel/sharded_optimizer.py
        profile = replace(profile, units=[replace(u, stepped=u.name not in elsewhere,
                                                  keeps_grads=not grads_elsewhere or u.name not in elsewhere,
                                                  # ZeRO-3: [Note: parameters sent for each use]
                                                  holds_params=u.name not in exchanged or u.name not in elsewhere,
                                                  exchanged=u.name in exchanged)
                                          for u in profile.units])
    mode = cfg.memory.offload
    accumulation = _accumulation(cfg, profile, names)

    boundaries = _boundaries(cfg, accumulation, names)

    def place(hw: HardwareProfile) -> Plan:
        if accumulation is None:
            return place_shape(hw, shape)
        return choose_accumulation(lambda s, explain=True: place_shape(hw, s, explain), shape,
                                   accumulation == "unit", names,
                                   boundaries if boundaries != "auto" or hw.cuda else "device")

    def place_shape(hw: HardwareProfile, shape: TrainShape, explain: bool = True) -> Plan:
        if mode == "auto":
            res = search(profile, hw, budgets, shape, cfg.memory.checkpointing, names, explain)
        elif mode == "none":
            res = fixed(profile, hw, budgets, shape, Tier.DEVICE, cfg.memory.checkpointing,
                        f"{names.set('offload', 'none')} (plain PyTorch)", names)
        else:
            res = fixed(profile, hw, budgets, shape, Tier(mode), cfg.memory.checkpointing,
                        names.set("offload", mode), names)
        if mode != "auto" and shape.unit_major and not explain and not device_ok(res.prediction, budgets):
            # The user placed the states, not every micro-batch's activations at once: a unit-major candidate
            # past the device's budget is not the plan (choose_accumulation tries the next, or micro-batch-major).
            tier, need, have = violations(res.prediction, budgets)[0]
            raise UsageError(f"unit-major order needs {format_size(need)} {tier} memory, {format_size(have)} "
                             "available")
        return as_plan(res, hw, shape)

    def as_plan(res, hw: HardwareProfile, shape: TrainShape) -> Plan:
        placement = res.placement if not elsewhere else replace(
            res.placement, stepped_elsewhere=elsewhere, grads_elsewhere=grads_elsewhere, exchanged=exchanged)
        return Plan(placement, res.prediction, {"device": budgets.device, "host": budgets.host,
                                                    "nvme": budgets.nvme if budgets.nvme_dir else None},
                    budgets.source, res.reasons, mode, shape, res.profile, hw, budgets.shared)

    plan = place(hardware)
    if plain_if_still and mode == "auto" and averaging is None and cfg.memory.accumulation != "unit" \
            and shape.compute_bytes == 4 and moves_nothing(plan):
        plain = replace(shape, engine=False)
        where = "GPU" if plan.hardware.cuda else "CPU"
        res = fixed(profile, hardware, budgets, plain, Tier.DEVICE, "off", names.set("offload", "auto"), names)
        res.reasons.insert(0, f"engine: none; every state fits on the {where} and nothing would move between tiers, "
                              f"so plain PyTorch and fused AdamW run the step ({names.set('offload', 'device')} runs "
                              "the offload engine there)")
        plan = as_plan(res, hardware, plain)
    if accumulation is None and plan.shape.engine and (why := _why_not_unit_major(cfg, profile)):
        plan.reasons.insert(0, why)
    swap = plan.prediction.peak.get("nvme", 0)
    if swap and (at_volume := hardware.at_disk_volume(swap)) is not hardware:
        plan = place(at_volume)  # the disk's rates over the volume this run keeps there ([Note: sustained bandwidth])
        plan.reasons.append(f"disk rates: those measured over {format_size(at_volume.nvme_measured_bytes)}, the "
                            f"least volume measured that holds this run's {format_size(swap)} of swap")
    for warning in (plan.disk_warning(), plan.pressure_warning()):
        if warning is not None:
            plan.reasons.append(warning)
    if mode == "auto" and plan.shape.engine:  # plain PyTorch: everything fits already, nothing to buy
        from tightfit.planner.suggest import what_more_buys

        line = what_more_buys(profile, plan.hardware, budgets, shape, cfg.memory.checkpointing, names,
                              plan.prediction.step_s, plan.prediction.bottleneck)
        if line:
            plan.reasons.append(line)
    if not plan.profile.measured:  # printed wherever the plan is: the summary, `tightfit plan`, --json
        plan.reasons.append(f"warning: activations not measured: {plan.profile.note}; a formula (16 hidden-sized "
                            "tensors saved per block) with a 25% margin stands in, which has been 42-71% short "
                            "for Hugging Face models; check the device peak against a short run")
    if cfg.memory.trace:
        from tightfit.planner.trace import write_trace

        write_trace(plan, cfg.memory.trace)
    return plan


def moves_nothing(plan: Plan) -> bool:
    """Does the plan leave every state of every unit on the device, with no layer tiled and no unit checkpointed?

    [Note: nothing to move, no engine] Such a plan gives the offload engine nothing to do that plain PyTorch does
    not: no state crosses a link, no unit is recomputed or tiled. What the engine still does there is its own cost:
    hooks at every unit, its gradients' hand-off into its flat buffers, its queued steps (about 3 ms a step of the
    reference GPT on the 2-core VM, 2-5% of a step: benchmarks/RESULTS.md, batches AO and AT). So `tightfit train
    --offload auto` runs plain PyTorch and fused AdamW then, planned as `--offload none` is (the engine's host time
    not counted) and compared with the run as any plan is; `--offload device` still runs the engine there.
    Only in fp32, where plain PyTorch holds what the plan counts (the parameters are their own master). Under bf16 or
    fp16 autocast plain PyTorch keeps fp32 parameters, frozen ones included, and saves their casts for the backward:
    a LoRA fine-tune's frozen base at 4 + 2 bytes a parameter where the plan counts the engine's 2. Until the plan
    counts that layout, the engine runs those."""
    p = plan.placement
    if p.tiled_linears or p.checkpoint_units:
        return False
    return all(p.of(u.name).tier(s) == Tier.DEVICE for u in plan.profile.units for s in State)


def _accumulation(cfg, profile, names: Naming) -> str | None:
    """The accumulation orders to plan: "unit" (asked for), "auto" (plan both, keep the faster), or None (micro-batch
    major only: plain PyTorch, one micro-batch and nothing asked, or units that do not form a chain)."""
    asked, accum = cfg.memory.accumulation, cfg.train.grad_accum
    flag = names.set("accumulation", "unit")
    if asked == "micro" or (asked == "auto" and accum == 1):
        return None
    if cfg.memory.offload == "none":
        if asked == "unit":
            raise UsageError(f"{flag}: needs the offload engine; drop {names.set('offload', 'none')}")
        return None
    if profile.chain:  # "" is a chain; None: not traced
        if asked == "unit":
            raise UsageError(f"{flag}: this model's units do not form a chain ({profile.chain}); use "
                             f"{names.set('accumulation', 'micro')}")
        return None
    if profile.chain is None:
        if asked == "unit":
            raise UsageError(f"{flag}: the planner could not trace this model, so cannot tell whether its units "
                             f"form a chain; use {names.set('accumulation', 'micro')}")
        return None
    return asked


def _why_not_unit_major(cfg, profile) -> str:
    """Why an offloaded run of several micro-batches, its order left to the planner, runs micro-batch-major when
    the model is the reason ("" otherwise): each micro-batch's gradients then leave the device, which a user of a
    large model must be able to see (the H200's torch once made every Llama's check fail, silently)."""
    if cfg.memory.accumulation != "auto" or cfg.train.grad_accum == 1 or cfg.memory.offload == "none":
        return ""
    if profile.chain:
        why = f"this model's units do not form a chain ({profile.chain})"
    elif profile.chain is None:
        why = "the planner could not trace this model to tell whether its units form a chain"
    else:
        return ""
    return (f"accumulation: micro-batch-major, each micro-batch's gradients leaving the device: {why}, which "
            "unit-major order needs")


def _boundaries(cfg, accumulation: str | None, names: Naming) -> str:
    """Where a unit-major plan may keep the units' saved inputs: "device", "host" (asked for), or "auto" (host where
    the device cannot hold them, on a GPU). Host needs unit-major order and torch >= 2.7."""
    from tightfit.offload.step.unit_major import EDGES

    asked = cfg.memory.boundaries
    flag = names.set("boundaries", "host")
    if asked == "host":
        if accumulation is None:
            raise UsageError(f"{flag}: only unit-major order keeps every micro-batch's block inputs until backward; "
                             f"add {names.set('accumulation', 'unit')} (with {names.set('grad_accum', 'M')}, M > 1)")
        if not EDGES:
            raise UsageError(f"{flag}: needs torch >= 2.7 (this is {torch.__version__}); use "
                             f"{names.set('boundaries', 'device')}")
    return asked if EDGES else "device"


def choose_accumulation(place, shape: TrainShape, forced: bool, names: Naming, boundaries: str = "device") -> Plan:
    """Plan unit-major order (offload/step/unit_major.py) and, unless it was asked for, micro-batch-major order too;
    keep unit-major unless micro-batch-major is faster or it alone fits, and say why in the plan's reasons.
    `boundaries`: where unit-major order keeps the units' saved inputs ("auto": on the device if they fit there, else
    in host memory, [Note: boundaries on the host] in offload/step/boundaries.py)."""
    m = shape.grad_accum
    unit = None
    for on_host in {"device": (False,), "host": (True,), "auto": (False, True)}[boundaries]:
        last = on_host == (boundaries != "device")  # the last candidate: its failure is the user's when forced
        try:
            unit = place(replace(shape, unit_major=True, boundaries_on_host=on_host), forced and last)
            if unit.placement.tiled_linears:  # tiles share their input: not a chain (unit_major.py)
                if forced:
                    raise UsageError(f"{names.set('accumulation', 'unit')}: the plan tiles layers, whose tiles "
                                     f"share their input; use {names.set('accumulation', 'micro')}")
                unit = None
        except UsageError:
            if forced and last:
                raise
            unit = None
        if unit is not None:
            break
    if unit is not None and unit.shape.boundaries_on_host:
        unit.reasons.insert(0, f"boundaries: the block inputs of {m} micro-batches wait in host memory "
                               f"({format_size(unit.prediction.breakdown['host'].get('boundaries', 0))}), each "
                               "down and up the link once a step")
    if forced:
        unit.reasons.insert(0, f"accumulation: unit-major ({names.set('accumulation', 'unit')}): each unit runs the "
                               f"{m} micro-batches back to back")
        return unit
    micro = place(shape)
    if unit is None:
        micro.reasons.insert(0, "accumulation: micro-batch-major (unit-major order's activations of "
                                f"{m} micro-batches at once do not fit, or it would tile layers)")
        return micro
    u, b = unit.prediction.step_s, micro.prediction.step_s
    if b < u * 0.98:
        why = ("its forwards run on threads of their own, at one core's speed on a CPU" if not micro.hardware.cuda
               else f"its {m} micro-batches' activations at once cost recomputation or streaming")
        micro.reasons.insert(0, f"accumulation: micro-batch-major ({b * 1e3:.0f} ms per step, against "
                                f"{u * 1e3:.0f} ms unit-major: {why})")
        return micro
    averaged = f" and averaged over the {shape.ranks} ranks once" if shape.ranks > 1 else ""
    unit.reasons.insert(0, f"accumulation: unit-major, each unit runs the {m} micro-batches back to back: its "
                           f"params cross once a step and its gradients leave once, summed on the device{averaged} "
                           f"({u * 1e3:.0f} ms per step, against {b * 1e3:.0f} ms micro-batch-major)")
    return unit


def _computes_on_cuda(device: str, hw: HardwareProfile, given: bool, what_if: bool, names: Naming) -> bool:
    """Does the plan compute on a CUDA GPU? --device, with auto meaning the planned machine's GPU when it has one.
    A device the planned machine lacks is refused, never ignored: --device cuda on a machine without a GPU names
    the way to plan for one (--hardware). --device cpu on this machine's GPU plans CPU compute (as `tightfit train
    --device cpu` runs); on another machine's GPU profile it is refused: the profile's speeds are its GPU's."""
    if device == "auto":
        return hw.cuda if given else (hw.cuda and torch.cuda.is_available())
    if device == "cuda" and not hw.cuda:
        if given:
            raise UsageError(f"{names.set('device', 'cuda')}: the hardware planned for ({hw.device_name}) has no "
                             "CUDA GPU; plan for one with a GPU profile")
        raise UsageError(f"{names.set('device', 'cuda')}: this machine has no CUDA GPU; to plan for one, add "
                         f"{names.set('hardware', 'FILE')} or a named profile ({', '.join(PROFILES)})")
    if device == "cpu" and hw.cuda and what_if:
        raise UsageError(f"{names.set('device', 'cpu')}: the hardware planned for is a GPU ({hw.device_name}) whose "
                         "speeds are the GPU's; plan CPU compute with a CPU profile (tightfit probe on that machine)")
    return device == "cuda"
