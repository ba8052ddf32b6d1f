"""The CUDA path, checked on one GPU in under five minutes (run through scripts/gpu_check.sh).

What it runs, each as a real DeadPool job of the example GPT (examples/gpt/train.py): one worker on the GPU
and one spare without a GPU of its own (it holds the replicas in host memory and, once called, takes the
GPU of the rank it replaces: coordinator/policy.place_devices).

  1. correctness, with the deterministic switch on and then off: a failure-free run; a SIGKILL in the
     backward pass; a SIGKILL in the middle of the device-to-host snapshot copy. Each faulty run must
     end on the failure-free run's final state (sha256 of every registered tensor, bit for bit) and
     losses, with the spare on cuda:0 after the swap.
  2. the snapshot path: slots pinned from snapshot 1 on, at their exact size, and shared: the spare, on
     the same machine, maps them and is streamed nothing; device-to-host GB/s of the snapshot copies
     against PCIe's ~55-64 GB/s.
  3. failure-free overhead of a snapshot every step against snapshots off, with a model whose step
     takes >= 100 ms (mean step time over the measured steps, as `deadpool bench overhead` measures).

Prints a report and writes it as JSON to OUT/gpu_check.json. Exit code 0 when every check passed.
`--rehearse` runs the same sequence on the CPU (gloo, small models, fewer steps) to check the script
itself on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deadpool.bench.limits import measure_bandwidths
from deadpool.config import Fault, JobConfig
from deadpool.events import read_events
from deadpool.launcher.launch import launch
from deadpool.runtime.digest import hash_pool

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"
SMALL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--block-size", "128", "--batch-size", "16"]
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "4"]  # rehearsal
# ~57M parameters (0.68 GB of state with AdamW); 64 x 256 tokens a step: about 5.6 TFLOP, >= 100 ms in fp32
LARGE = ["--n-layer", "8", "--n-head", "12", "--n-embd", "768", "--block-size", "256", "--batch-size", "64",
         "--dropout", "0.0"]
PCIE_GBPS = (55.0, 64.0)


@dataclass(frozen=True)
class Run:
    name: str
    summary: dict[str, Any]
    events: list[dict[str, Any]]

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def job(out: Path, backend: str, name: str, script_args: list[str], *, spares: int = 1, every: int | str = 1,
        deterministic: bool = True, faults: tuple[Fault, ...] = ()) -> Run:
    config = JobConfig(script=str(EXAMPLE), script_args=tuple(script_args), workers=1, spares=spares,
                       run_dir=str(out / name), backend=backend, snapshot_every=every, deterministic=deterministic,
                       faults=faults, collective_timeout_s=120.0, connect_timeout_s=120.0)
    started = time.monotonic()
    code, summary = launch(config, echo=None)
    print(f"  {name}: exit {code} in {time.monotonic() - started:.1f} s", flush=True)
    return Run(name, summary, list(read_events(out / name / "events.jsonl")))


def correctness(out: Path, backend: str, model: list[str], deterministic: bool) -> dict[str, Any]:
    """A failure-free run and two kills in step 12; each faulty run against the failure-free one."""
    tag = "det" if deterministic else "nondet"
    args = [*model, "--steps", "24", "--log-every", "4"]
    reference = job(out, backend, f"reference-{tag}", args, deterministic=deterministic)
    result: dict[str, Any] = {"reference_exit": reference.summary["exit_code"]}
    for phase in ("backward", "snapshot_copy"):
        run = job(out, backend, f"kill-{phase}-{tag}", args, deterministic=deterministic,
                  faults=(Fault(kind="kill", rank=0, step=12, phase=phase),))
        devices = {e.get("device") for e in run.named("group_joined") if e.get("proc") == "s0"}
        taker = [e for e in run.named("snapshot") if e["proc"] == "s0"]
        result[f"kill_{phase}"] = {
            "exit": run.summary["exit_code"],
            "swaps": run.summary["swaps"],
            "spare_device": sorted(d for d in devices if d),
            "taker_snapshots_pinned": bool(taker) and all(e["pinned"] for e in taker),
            "state_equal": run.summary["final_state_sha256"] == reference.summary["final_state_sha256"],
            "losses_equal": run.summary["losses"] == reference.summary["losses"],
            "fault_to_next_step_s": [r["fault_to_next_step_s"] for r in run.summary["recoveries"]],
            "restore_s": [r["restore_s"] for r in run.summary["recoveries"]],
        }
    return result


def snapshot_path(run: Run) -> dict[str, Any]:
    """Pinned slots and device-to-host bandwidth, from the snapshot events of the worker: `landed_s` is the
    copy until its last byte is in the slot (training may go on), `copy_s` until it is hashed too, and the
    rest of `total_s` (after the wait for a free slot) is the stream to the holder and its acknowledgement."""
    snaps = [e for e in run.named("snapshot") if e.get("role") == "worker"]
    later = [e for e in snaps if e["step"] >= 1]
    rates = [e["bytes"] / e["landed_s"] / 1e9 for e in later if e["landed_s"] > 0]

    def median(field: str) -> float | None:
        return statistics.median(e[field] for e in later) if later else None

    return {"snapshots": len(snaps), "bytes": snaps[-1]["bytes"] if snaps else None,
            "pinned_from_step_1": bool(later) and all(e["pinned"] for e in later),
            "step_0_pinned": snaps[0]["pinned"] if snaps else None,
            "bytes_streamed_to_holders": sum(e["sent"] for e in snaps),  # 0: the spare maps the slots
            "d2h_gbps_median": statistics.median(rates) if rates else None,
            "d2h_gbps_max": max(rates) if rates else None,
            "landed_s_median": median("landed_s"), "copy_and_hash_s_median": median("copy_s"),
            "slot_wait_s_median": median("slot_wait_s"),
            "send_s_median": statistics.median(e["total_s"] - e["slot_wait_s"] - e["copy_s"] for e in later)
            if later else None,
            "engine_s_median": median("total_s")}


def machine(nbytes: int) -> dict[str, Any]:
    """This machine's own ceilings: one-core memcpy, hash and loopback TCP (bench/limits.py, as `deadpool
    bench overhead` prints them), and one device-to-host copy of `nbytes` into pinned and into pageable
    memory (best of 3)."""
    rates, pool = measure_bandwidths(), hash_pool()
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {"memcpy_gbps": rates.memcpy / 1e9, "hash_gbps": rates.hash / 1e9, "hash": rates.hash_name,
              "copy_and_hash_gbps": rates.copy_and_hash / 1e9, "loopback_gbps": rates.loopback / 1e9,
              "cores": rates.cores, "hash_threads": pool[1] if pool else 0}
    for kind, target in (("pinned", torch.empty(nbytes, dtype=torch.uint8).pin_memory()),
                         ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        target.fill_(0)  # pages touched before the copies
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source, non_blocking=kind == "pinned")
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        result[f"d2h_{kind}_gbps"] = nbytes / best / 1e9
    return result


def mean_step_s(run: Run, skip: int) -> float:
    """Mean wall time between consecutive step ends on the worker, after `skip` warm-up steps."""
    t = [e["t"] for e in run.named("step") if e["role"] == "worker" and e["step"] > skip]
    return (t[-1] - t[0]) / (len(t) - 1)


def overhead(out: Path, backend: str, model: list[str]) -> dict[str, Any]:
    """Snapshots off against every step, the spare holding replicas, then without a spare (local slots only)."""
    args = [*model, "--steps", "30", "--log-every", "10"]
    runs = {"off": job(out, backend, "overhead-off", args, every=0),
            "every-1": job(out, backend, "overhead-every-1", args, every=1),
            "every-1-no-spare": job(out, backend, "overhead-every-1-no-spare", args, every=1, spares=0)}
    steps = {name: mean_step_s(run, skip=10) for name, run in runs.items()}
    blocked = [e["wait_s"] for e in runs["every-1"].named("step") if e["role"] == "worker" and e["step"] > 10]
    # `auto` settles its interval at the end of its calibration (step 24): measured after step 30
    auto = job(out, backend, "overhead-auto", [*model, "--steps", "60", "--log-every", "10"], every="auto")
    steps["auto"] = mean_step_s(auto, skip=30)
    return {"step_s": steps,
            "ratio_every_1": steps["every-1"] / steps["off"],
            "ratio_every_1_no_spare": steps["every-1-no-spare"] / steps["off"],
            "ratio_auto": steps["auto"] / steps["off"],
            "auto_every": [e["every"] for e in auto.named("snapshot_interval")],
            "training_wait_s_mean": statistics.mean(blocked) if blocked else None,
            "snapshot_path": snapshot_path(runs["every-1"]),
            "snapshot_path_no_spare": snapshot_path(runs["every-1-no-spare"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--rehearse", action="store_true", help="run the sequence on the CPU (no figures)")
    args = parser.parse_args()
    backend = "gloo" if args.rehearse else "nccl"
    device = "cpu" if args.rehearse else "cuda:0"
    if args.rehearse:
        report: dict[str, Any] = {"rehearsal": True, "python": platform.python_version(), "torch": torch.__version__}
    elif not torch.cuda.is_available():
        print("no CUDA device visible: this check needs a GPU", file=sys.stderr)
        return 2
    else:
        report = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "gpu": torch.cuda.get_device_name(0),
                  "gpus": torch.cuda.device_count()}
    print(json.dumps(report), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def save() -> None:  # after each part, so a run cut short by the time limit still leaves what it measured
        report["duration_s"] = time.monotonic() - started
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    if not args.rehearse:
        report["machine"] = machine(683_785_920)  # the large model's snapshot
        print(json.dumps(report["machine"]), flush=True)
    print("correctness, deterministic on:", flush=True)
    report["deterministic"] = correctness(args.out, backend, TINY if args.rehearse else SMALL, deterministic=True)
    save()
    print("correctness, deterministic off:", flush=True)
    report["nondeterministic"] = correctness(args.out, backend, TINY if args.rehearse else SMALL,
                                             deterministic=False)
    save()
    if not args.skip_overhead:
        print("overhead (snapshots off / every step):", flush=True)
        report["overhead"] = overhead(args.out, backend, TINY if args.rehearse else LARGE)

    det = report["deterministic"]
    checks = {f"deterministic: {k} -> same state and losses, spare on {device}":
              v["exit"] == 0 and v["swaps"] == 1 and v["state_equal"] and v["losses_equal"]
              and v["spare_device"] == [device]
              for k, v in det.items() if k.startswith("kill_")}
    if not args.rehearse:
        checks["the spare, once called, snapshots into pinned slots"] = all(
            v["taker_snapshots_pinned"] for k, v in det.items() if k.startswith("kill_"))
    if "overhead" in report and not args.rehearse:
        path = report["overhead"]["snapshot_path"]
        checks["slots pinned from snapshot 1 on"] = path["pinned_from_step_1"]
        checks["the spare on this machine maps the pinned slots (nothing streamed)"] = (
            path["snapshots"] > 0 and path["bytes_streamed_to_holders"] == 0)
        checks["large model step >= 100 ms"] = report["overhead"]["step_s"]["off"] >= 0.1
    report["checks"] = checks
    save()
    print(json.dumps(report, indent=2))
    nondet = report["nondeterministic"]
    print("\nwithout the deterministic switch the faulty runs end on the same state: "
          + ", ".join(f"{k}={v['state_equal']}" for k, v in nondet.items() if k.startswith("kill_")))
    if "overhead" in report:
        o = report["overhead"]
        print(f"overhead of a snapshot every step: x{o['ratio_every_1']:.3f} (spare holding replicas), "
              f"x{o['ratio_every_1_no_spare']:.3f} (no spare); auto x{o['ratio_auto']:.3f} at intervals "
              f"{o['auto_every']}; step {o['step_s']['off'] * 1e3:.0f} ms; "
              f"device-to-host {o['snapshot_path']['d2h_gbps_median'] or 0:.1f} GB/s (PCIe ~{PCIE_GBPS[0]:.0f}-"
              f"{PCIE_GBPS[1]:.0f} GB/s)")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
