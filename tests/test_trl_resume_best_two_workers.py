"""train.load_best_at_end after a restart with two workers: rank 1 is SIGKILLed (the test fault plan,
tests/faults.py) once the step-2 checkpoint is registered, its local Hugging Face folders removed as on
another node. lr 0.3 (constant) makes the first evaluation the best; the run must still end on the step-1
weights, fetched from the run's storage by every rank (the one-worker case is in test_trl_resume_edges.py)."""
from __future__ import annotations

import pytest

from tests.test_trl_resume import _recipe
from tests.test_trl_resume_edges import _run_with_fault, assert_ended_on_the_best_first_step


@pytest.mark.timeout(900)
def test_best_checkpoint_of_an_earlier_attempt_is_loaded_at_the_end_on_two_workers(tmp_path):
    import ray

    recipe = _recipe(tmp_path, "best2", 1, "scaling.num_workers=2", "train.max_steps=4", "train.lr=0.3",
                     "train.schedule=constant", "train.warmup_steps=0", "train.eval_every=1",
                     "train.checkpoint_every=1", "train.keep_checkpoints=5")
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        best, error = _run_with_fault(recipe, "2:1:saved")
    finally:
        ray.shutdown()
    assert error is None, f"the run failed: {error!r}"
    assert best.steps == 4
    from mlflow import MlflowClient

    params = MlflowClient(recipe.tracking_uri).get_run(best.mlflow_run_id).data.params
    assert any(".attempt2." in k for k in params), "no second attempt: the kill never happened"
    assert recipe.scaling.num_workers == 2
    assert_ended_on_the_best_first_step(recipe, best)
