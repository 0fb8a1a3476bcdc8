"""One Ray session shared by every Ray test in this directory: 3 logical CPUs on the 2-core box CI runs on, so the
asynchronous run's trainer worker and two rollout workers fit (test_rl_ray.py); two-worker groups fill 2 of them
and a third worker group of 2 finds no room (test_ray_groups.py)."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
