"""PyTorch's own distributed test cases (torch.testing._internal.distributed.distributed_test, as
Debian ships them) on backend "hcomm".

Run with BACKEND=hcomm WORLD_SIZE=2|3, PYTHONPATH=<build>/python:<this dir>/stubs; conftest.py keeps
exactly the cases named there and fails the run if any of them is skipped or missing (torch's
runner counts skips as passes).
"""
import os
import sys

os.environ.setdefault("BACKEND", "hcomm")
os.environ.setdefault("WORLD_SIZE", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))

import hcomm.torch  # noqa: E402,F401  (registers the backend; spawned ranks import this module again)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

DistTestCases.backend_feature["plugin"].add(os.environ["BACKEND"])

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
