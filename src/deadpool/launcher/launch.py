"""Runs one job on this machine: run directory, config, the coordinator's store, processes, summary."""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from deadpool.config import JobConfig
from deadpool.coordinator.policy import place_devices
from deadpool.coordinator.server import Coordinator
from deadpool.errors import ConfigError
from deadpool.events import EventLog
from deadpool.launcher.agent import Agent
from deadpool.report import summarize


def host_store(config: JobConfig) -> dist.TCPStore:
    """The control-plane store lives in the launcher, so no dying rank can take it down."""
    try:
        return dist.TCPStore(config.store_host, config.store_port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=config.connect_timeout_s))
    except Exception as error:  # torch raises DistNetworkError/RuntimeError with the socket's errno text
        first = str(error).splitlines()[0]
        raise ConfigError(f"cannot host the control-plane store on {config.store_host}:{config.store_port} "
                          f"({first}); pick a free port with --master-port, or 0 for any") from None


def count_gpus(config: JobConfig) -> int:
    """The GPUs this node's processes share out: none under gloo, else --gpus-per-node or all visible ones."""
    if config.backend == "gloo":
        return 0
    visible = torch.cuda.device_count()
    gpus = visible if config.gpus_per_node is None else config.gpus_per_node
    if gpus > visible:
        raise ConfigError(f"--gpus-per-node {gpus}, but {visible} GPUs are visible here")
    if config.backend == "nccl" and gpus == 0:
        raise ConfigError("--backend nccl needs GPUs, and none is visible here: use --backend gloo")
    return gpus


def launch(config: JobConfig, echo: TextIO | None = sys.stdout) -> tuple[int, dict]:
    """Runs the job to its end and returns (exit code, summary). The summary is also in run_dir/summary.json."""
    if not Path(config.script).is_file():
        raise ConfigError(f"training script {config.script!r} does not exist")
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").unlink(missing_ok=True)
    gpus = count_gpus(config)
    devices = place_devices(config.workers, config.spares, gpus)
    if not devices.ok:
        raise ConfigError(devices.reason)
    store = host_store(config)
    config = replace(config, gpus_per_node=gpus, store_port=store.port, token=config.token or secrets.token_hex(8),
                     run_dir=str(run_dir.resolve()), script=str(Path(config.script).resolve()))
    config_path = run_dir / "config.json"
    config.write(config_path)
    events = EventLog(run_dir / "events.jsonl", role="coordinator", proc="coordinator")
    events.emit("job_start", workers=config.workers, spares=config.spares, port=store.port,
                snapshot_every=config.snapshot_every, devices=devices.value, placement=devices.reason)
    agent = Agent(config, config_path, echo=echo)
    started = time.monotonic()
    try:
        code = Coordinator(config, store, events, agent).run()
    except BaseException:
        for name in agent.alive():
            agent.fence(name)
        agent.stop_all(grace_s=0.0)
        raise
    events.emit("job_end", exit_code=code, duration_s=time.monotonic() - started)
    events.close()
    summary = summarize(run_dir / "events.jsonl", exit_code=code)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return code, summary
