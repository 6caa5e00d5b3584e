"""Watching a run: metrics rows and TensorBoard (``metrics``), the live view (``progress``),
charts (``plots`` for a run's, ``formula_plots`` for the schedule and a scaling-law fit,
``plot_style`` for the look they share), the end-of-run health report (``report``), the
downstream scores read back and judged (``downstream``) and runs side by side (``compare``)."""
