import os

import pytest
import torch

# A hung collective must fail a test quickly, never stall CI.
os.environ.setdefault("SPARSECOMM_TIMEOUT", "60")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "engines" in item.nodeid:
            item.add_marker(pytest.mark.slow)
