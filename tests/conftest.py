import datetime

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group(tmp_path):
    """A world of size 1 (gloo) inside the test process itself, for validation tests."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()
