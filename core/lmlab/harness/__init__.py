"""Scoring runs on lm-evaluation-harness tasks (``lmlab eval RUN --tasks``): the run as an lm-eval
model (:mod:`lmlab.harness.model`), the tasks lmlab ships (``tasks/``, made by
scripts/make_harness_tasks.py) and the results written into the run (:mod:`lmlab.harness.scores`)."""
