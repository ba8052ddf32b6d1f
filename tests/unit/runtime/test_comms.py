"""Tests for deadpool/runtime/comms.py: which error is whose (a failure of some rank, or the script's)."""

import pytest
import torch.distributed as dist

from deadpool.runtime.comms import CollectiveAborted, is_communication_error


@pytest.mark.parametrize("error", [
    # what gloo raises on torch 2.13 when a peer dies or stops (a plain RuntimeError)
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17580"),
    RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection reset by peer"),
    RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"),
    dist.DistBackendError("NCCL communicator was aborted"),
    dist.DistNetworkError("Broken pipe"),
    CollectiveAborted("collective abandoned: the coordinator aborted this generation"),
])
def test_errors_of_the_communication_layer(error):
    assert is_communication_error(error)


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 32x64)"),
    ValueError("text file not found: /data/missing.txt"),
    KeyError("lr"),
    ZeroDivisionError("division by zero"),
    OSError("[Errno 2] No such file or directory: 'ckpt.pt'"),
])
def test_errors_of_the_script(error):
    assert not is_communication_error(error)
