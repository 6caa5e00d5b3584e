"""The typed reader of a run's ``config.json``: the document a launch writes
(``anneal.resolution.resolve.Launch.config_document``: ``run``, ``ds_config``, ``resolved_from``,
``model``, ``launch`` and a cooldown branch's ``cooldown``), read once into a ``RunRecord`` whose
accessors give each reader the part it needs: the plots and the report, the memory estimate,
the scaling fit, the cooldown branches, the launch resolution and the export.

``anneal.rundir`` names the file, writes it and reads it through ``RunRecord.from_file``
(``rundir.read_record``, ``rundir.record_or_empty``); ``anneal estimate --model FILE`` reads a
JSON file that may be a run's and asks ``RunRecord.holds`` whether it is. Every accessor is
lenient: a section or key that is missing or of another type reads as empty (None, ``{}``),
so that a file edited by hand or written by an older Anneal never raises where a reader only
draws a label; the strict checks of a launch are ``anneal.resolution``'s. Imports only the ground
floor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from anneal.errors import UserError
from anneal.json_values import is_number


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _number_or_none(value) -> int | float | None:
    return value if is_number(value) else None


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run's ``config.json``, read once. ``doc`` is the document as written (the launch
    compares a relaunch with it key by key); ``path`` is where it was read (None when made
    from a document)."""

    doc: dict
    path: Path | None = None

    @classmethod
    def from_file(
        cls, path: str | Path, *, section: str = "run", missing_ok: bool = False
    ) -> RunRecord | None:
        """The run's ``config.json`` at ``path``: a UserError naming the file when it cannot be
        read or is not a run's (a JSON object with a ``section`` object: "run" for the launch
        and the runs, "model" for the exporter, which needs only the shape). When there is
        none: None with ``missing_ok``, else a UserError."""
        path = Path(path)
        run_dir, name = path.parent, path.name
        if not path.is_file():
            if missing_ok and not path.exists():
                return None
            raise UserError(
                f"{run_dir}: no {name}; not an Anneal run directory (give the --out of a run)."
            )
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise UserError(
                f"{path}: cannot be read as JSON ({e}); it is not as the run wrote it. Give a run "
                f"directory whose {name} is intact, or restore this one."
            ) from None
        if not (isinstance(doc, dict) and isinstance(doc.get(section), dict)):
            raise UserError(
                f"{path}: not a run's {name} (no '{section}' section). Give the --out of a run."
            )
        return cls(doc, path)

    @classmethod
    def lenient(cls, path: str | Path) -> RunRecord:
        """The ``config.json`` at ``path`` when it is a readable JSON object, else an empty
        record (for labels and optional checks that have something else to fall back on)."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError):
            doc = {}
        return cls(_dict(doc), Path(path))

    @staticmethod
    def holds(doc) -> bool:
        """Whether JSON document ``doc`` is a run's config.json (not a Hugging Face config or
        a flat preset): an object with any of a run's sections (``run``, ``model``,
        ``ds_config``) as an object."""
        return isinstance(doc, dict) and any(
            isinstance(doc.get(k), dict) for k in ("run", "model", "ds_config")
        )

    # -- the sections ---------------------------------------------------------------------------

    @property
    def run(self) -> dict:
        """The run config as launched (``anneal.config.run.RunConfig.to_dict``)."""
        return _dict(self.doc.get("run"))

    @property
    def model(self) -> dict:
        """The resolved model: the preset's fields, ``seq_len`` and ``params``."""
        return _dict(self.doc.get("model"))

    @property
    def ds_config(self) -> dict:
        """The DeepSpeed config exactly as the engine got it ("auto" values filled in)."""
        return _dict(self.doc.get("ds_config"))

    @property
    def launch(self) -> dict:
        """World size, the parallel degrees and the device kind."""
        return _dict(self.doc.get("launch"))

    @property
    def cooldown(self) -> dict | None:
        """A cooldown branch's start (``anneal.resolution.cooldown.Cooldown.to_dict``), else
        None. An Anneal before issue 40 wrote it as the ``branch`` section."""
        cooldown = self.doc.get("cooldown", self.doc.get("branch"))
        return cooldown if isinstance(cooldown, dict) else None

    # -- what the readers need ------------------------------------------------------------------

    @property
    def optim(self) -> dict:
        return _dict(self.run.get("optim"))

    @property
    def train_settings(self) -> dict:
        """``run.train``: the training settings as launched (``anneal.config.run.TrainConfig``)."""
        return _dict(self.run.get("train"))

    @property
    def data_path(self) -> str | None:
        """``run.data.path``: the prepared data directory the run was started with."""
        path = _dict(self.run.get("data")).get("path")
        return path if isinstance(path, str) else None

    @property
    def vocab_size(self) -> int | None:
        vocab = self.model.get("vocab_size")
        return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None

    @property
    def params(self) -> int | float | None:
        """The model's parameter count, embeddings included."""
        return _number_or_none(self.model.get("params"))

    @property
    def device(self) -> str:
        """The device kind the run launched on, "?" when not recorded (only a label)."""
        return str(self.launch.get("device", "?"))

    @property
    def scheduler_params(self) -> dict:
        return _dict(_dict(self.ds_config.get("scheduler")).get("params"))

    @property
    def peak_lr(self):
        """``optimizer.params.lr`` as resolved (a number, or what the file holds)."""
        return _dict(_dict(self.ds_config.get("optimizer")).get("params")).get("lr")

    @property
    def warmup_steps(self) -> int | None:
        """The resolved ``warmup_num_steps``, None when it is not an integer."""
        warm = self.scheduler_params.get("warmup_num_steps")
        return warm if isinstance(warm, int) and not isinstance(warm, bool) else None

    @property
    def gradient_clipping(self) -> int | float | None:
        return _number_or_none(self.ds_config.get("gradient_clipping"))

    @property
    def zero_stage(self):
        """``zero_optimization.stage`` of the resolved ds_config (None when absent)."""
        return _dict(self.ds_config.get("zero_optimization")).get("stage")

    @property
    def loss_settings(self) -> dict:
        """``train.loss`` and ``train.loss_chunk_tokens`` as the run trained (those present)."""
        return {k: v for k, v in self.train_settings.items() if k in ("loss", "loss_chunk_tokens")}

    @property
    def parent_run(self) -> Path | None:
        """The parent run directory a cooldown branch names (None when not a branch)."""
        parent = (self.cooldown or {}).get("parent_run")
        return Path(parent) if isinstance(parent, str) and parent else None
