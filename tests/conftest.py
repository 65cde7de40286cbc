import os

import pytest

# Keep tests predictable on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def real_model_path():
    from pdserve.engine.loader import default_model_path

    return default_model_path()
