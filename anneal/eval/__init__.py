"""Downstream evaluation: a model judged by what it can do, on lm-evaluation-harness tasks.

Scores come from lm-eval's own task and metric code over Anneal's engine, on every rank in
lockstep (every rank builds the same request list; each batch is split over the data-parallel
replicas and the results all-gathered, so every rank calls forward the same number of times).
``anneal eval`` scores a run's checkpoints, beside the run or after it; the Trainer scores in the
loop (``train.eval_tasks``). Results go to ``RUN/evals/step-<N>.json`` (``anneal.rundir``) and to
the run's metrics as ``eval/<task>/<metric>`` rows. docs/evaluation.md.
"""
