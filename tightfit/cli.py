"""The `tightfit` command: train, plan, probe, env.

Why this file is thin: every flag comes from the typed config dataclasses (tightfit/config.py); each subcommand
hands a validated `Config` to the component that owns it. Bad input anywhere raises `UsageError`, which ends here
as one line on stderr and exit status 2 — no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tightfit import __version__
from tightfit.config import Config, add_config_args, config_from_args
from tightfit.errors import UsageError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tightfit", description="Train PyTorch models that do not fit your hardware.")
    parser.add_argument("--version", action="version", version=f"tightfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the reference GPT on the Python stdlib source)")
    add_config_args(train)

    plan = sub.add_parser("plan", help="show where each state would live, predicted memory and step time")
    add_config_args(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--hardware", metavar="FILE|NAME", default=None,
                      help="plan for another machine: a profile file (JSON or TOML, e.g. from `tightfit probe --out`) "
                           "or a named profile: gpu24-pcie4, gpu40-pcie4, gpu80-pcie5 (docs/PLANNER.md)")

    probe = sub.add_parser("probe", help="measure this machine's bandwidths and throughputs (cached for planning)")
    probe.add_argument("--nvme", default=None, help="swap folder whose disk to measure (default: the cache folder)")
    probe.add_argument("--disk-volume", metavar="SIZE", default=None,
                       help="measure the disk over this many bytes (default: 16GiB, at most a quarter of the free "
                            "space); make it the swap a run keeps, when a cache in front of the disk is larger")
    probe.add_argument("--out", metavar="FILE.json", default=None,
                       help="also write the profile to this file, for `tightfit plan --hardware FILE` elsewhere")

    env = sub.add_parser("env", help="torch version, devices and memory, host RAM, free disk")
    env.add_argument("--nvme", default=None, help="swap folder whose free space to report")
    env.add_argument("--json", action="store_true", help="print as JSON")
    return parser


def _world_size(cfg: Config) -> int:
    return cfg.parallel.nproc_per_node * cfg.parallel.nnodes


def _cmd_train(cfg: Config, argv: list[str]) -> int:
    from tightfit.train.preflight import check_outputs

    check_outputs(cfg)  # every path the run writes, before the first step (train/preflight.py)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from tightfit.parallel.run import run_worker

        run_worker(cfg)  # a rank's process ends there, whatever happens ([Note: leaving the process group])
    if _world_size(cfg) > 1:
        from tightfit.parallel.launcher import launch

        return launch(cfg, argv)
    from tightfit.train.loop import train

    return train(cfg).exit_code  # 128 + the signal's number when one stopped it (a checkpoint saved)


def _disk_volume(text: str | None, nvme: str | None) -> int | None:
    """`tightfit probe --disk-volume`'s bytes, checked against the swap folder's free space (None: not given)."""
    if text is None:
        return None
    if not nvme:
        raise UsageError("--disk-volume: measures the swap folder's disk; add --nvme DIR")
    from tightfit.planner.disk_probe import SEGMENTS, MAX_TRANSFER
    from tightfit.utils.sizes import format_size, parse_size

    volume, least = parse_size(text, "--disk-volume"), SEGMENTS * MAX_TRANSFER
    if volume < least:
        raise UsageError(f"--disk-volume: {format_size(volume)} is below the least the probe measures, "
                         f"{format_size(least)}")
    from tightfit.planner.hardware import free_bytes

    free = free_bytes(nvme)
    if volume > free:
        raise UsageError(f"--disk-volume: {format_size(volume)} but {format_size(free)} is free under {nvme}; "
                         "free space or measure a smaller volume")
    return volume


def _cmd_plan(cfg: Config, as_json: bool, hardware: str | None = None) -> int:
    hw = None
    if hardware:
        from tightfit.planner.hardware_file import load_hardware

        hw = load_hardware(hardware)
    if _world_size(cfg) > 1 and cfg.parallel.strategy != "auto":
        from tightfit.parallel.plan import plan_from_config

        if plan_from_config(cfg.parallel, _world_size(cfg), cfg.memory.offload).engine:  # the engine on each rank
            from tightfit.parallel.rank_plan import rank_plan, rank_plan_text

            plan, ranks = rank_plan(cfg, hw)
            print(json.dumps({**json.loads(plan.to_json()), "ranks": ranks}, indent=2) if as_json
                  else rank_plan_text(plan, ranks))
            return 0
    if _world_size(cfg) > 1:
        if hardware:
            raise UsageError("--hardware: plans one process, or each rank of --strategy ddp with --offload host|nvme; "
                             "for other strategies use --gpu-mem and --interconnect")
        from tightfit.parallel.whatif import what_if

        report = what_if(cfg)
        print(json.dumps(report.to_dict(), indent=2) if as_json else report)
        return 0
    from tightfit.planner import make_plan
    from tightfit.train.loop import build_meta_model

    plan = make_plan(build_meta_model(cfg), cfg, hw, what_if=hw is not None, plain_if_still=True)  # as train runs
    print(plan.to_json() if as_json else plan.table())
    return 0


def _reported_to_launcher(e: UsageError) -> bool:
    """A rank of `tightfit train --nproc-per-node N` leaves its error line to the launcher, which prints one for
    the run (parallel/launcher.py); anything else prints its own."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    from tightfit.parallel.launcher import report_failure

    return report_failure(e.exit_code, str(e))


def main(argv: list[str] | None = None) -> int:
    from tightfit.utils.malloc_arenas import limit_arenas

    limit_arenas()  # before any thread: [Note: one heap for the engine's threads]
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "env":
            from tightfit.env import environment, format_environment

            env = environment(args.nvme)
            print(json.dumps(env, indent=2) if args.json else format_environment(env))
            return 0
        if args.command == "probe":
            from tightfit.planner.probe import run_probe
            from tightfit.utils.run_lock import check_folder_path

            if args.nvme:
                check_folder_path(Path(args.nvme), "--nvme")  # one line, not makedirs' traceback
            hw = run_probe(args.nvme, disk_volume=_disk_volume(args.disk_volume, args.nvme))
            print(hw)
            if args.out:
                from tightfit.planner.hardware_file import save_hardware

                print(f"  profile written to {save_hardware(hw, args.out)}")
            return 0
        cfg = config_from_args(args)
        if cfg.parallel.strategy != "auto" and _world_size(cfg) == 1 and "WORLD_SIZE" not in os.environ:
            print(f"tightfit: note: --strategy {cfg.parallel.strategy} applies to runs of several processes; this "
                  "one is a single process (--nproc-per-node 1), which runs no strategy", file=sys.stderr)
        if args.command == "train":
            return _cmd_train(cfg, argv)
        return _cmd_plan(cfg, args.json, args.hardware)
    except UsageError as e:
        if not _reported_to_launcher(e):
            print(f"tightfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tightfit: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:  # an allocation the process limit (ulimit -v) or the machine refused,
        # past every check (torch's CPU allocator raises a RuntimeError for it)
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit = "" if soft == resource.RLIM_INFINITY else f" (its address-space limit, ulimit -v, is {soft >> 20} MiB)"
        print(f"tightfit: error: out of memory: an allocation failed{limit}; give the run more memory, or lower "
              "--cpu-mem so that the plan keeps less in it", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
