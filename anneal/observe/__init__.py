"""Watching a run: metrics rows and TensorBoard (``metrics``), the live view (``progress``),
charts (``plots``) and the end-of-run health report (``report``)."""
