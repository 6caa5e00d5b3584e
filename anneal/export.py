"""The exporter moved to ``anneal.hf`` (issue 19). Only the training loop's per-save export
(``train.export_every_save``) still imports this name; this module goes when that export runs
as a child process (``anneal export``), as the issue plans."""

from anneal.hf.export import export_at_save

__all__ = ["export_at_save"]
