"""Pinning a service to CPUs caps torch's threads at the CPUs pinned (in a child process: affinity is per
process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PIN = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from specsplit.lmkit import models
models.configure_torch_threads({threads})
models.pin_cpus("{cpu}", {threads})
print(torch.get_num_threads())
"""


def test_threads_above_the_pinned_cpus_are_capped_with_a_warning():
    cpu = min(os.sched_getaffinity(0))  # one this process may run on (a container's cpuset need not hold 0)
    done = subprocess.run([sys.executable, "-c", PIN.format(cpu=cpu, threads=2)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == 1
    assert f"--threads 2 on 1 pinned CPU(s) (--cpus {cpu}): running 1" in done.stderr
