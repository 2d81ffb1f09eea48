"""Which call in a main process keeps its forked children from using CUDA: each step below runs
alone in a fresh process, then a child forked from it tries to put a tensor on the GPU.

    python3 .gpu/fork_check.py        # on the GPU machine, from the repository's root
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch


def child_uses_cuda() -> str:
    pid = os.fork()
    if pid == 0:
        try:
            torch.zeros(1, device="cuda").add_(1).item()
            os._exit(0)
        except Exception as error:  # noqa: BLE001 - the message is the finding
            print(f"    child: {str(error).splitlines()[0]}", flush=True)
            os._exit(1)
    return "yes" if os.waitpid(pid, 0)[1] == 0 else "NO"


def plain_cpu_fit() -> None:
    from tests.conftest import trainer
    from tests.models import Net, regression_data

    trainer(None, max_steps=2).fit(Net().double(), regression_data())


def pytest_collection() -> None:
    import pytest

    pytest.main(["--co", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"])


STEPS: dict[str, Callable[[], object]] = {
    "nothing": lambda: None,
    "torch.cuda.device_count()": torch.cuda.device_count,
    "torch.cuda.is_available()": torch.cuda.is_available,
    "torch._C._cuda_getDeviceCount()": lambda: torch._C._cuda_getDeviceCount(),
    "import lightning, lightning_hetero": lambda: __import__("lightning_hetero"),
    "a plain Lightning fit on the CPU": plain_cpu_fit,
    "pytest's collection of tests/test_cuda.py": pytest_collection,
}

if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    if len(sys.argv) > 1:  # one step, in this fresh process
        name = sys.argv[1]
        STEPS[name]()
        print(f"after {name}: a forked child uses CUDA: {child_uses_cuda()};"
              f" torch.cuda.is_initialized() here: {torch.cuda.is_initialized()}", flush=True)
    else:
        print("PYTORCH_NVML_BASED_CUDA_CHECK =", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), flush=True)
        for name in STEPS:
            subprocess.run([sys.executable, __file__, name], check=False)
