"""The Chinchilla law, its two published fits, and reading a fit file.

The law (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", eq. 2)::

    L(N, D) = E + A / N**alpha + B / D**beta

with N parameters, D training tokens and L the loss in nats per token. Training compute is
``C = 6 N D`` FLOPs (Kaplan et al. 2020), and minimising L on that constraint gives (eq. 4)::

    N*(C) = G (C/6)**a,   D*(C) = (C/6)**b / G,
    G = (alpha A / (beta B))**(1/(alpha+beta)),  a = beta/(alpha+beta),  b = alpha/(alpha+beta).

On that frontier ``alpha A / N**alpha = beta B / D**beta``, so a target loss L gives N* in
closed form: ``N* = (A (1 + alpha/beta) / (L - E))**(1/alpha)``.

Two published fits ship: Hoffmann's approach 3 and the Epoch AI replication (Besiroglu et al.
2024, "Chinchilla Scaling: A replication attempt"), which refitted the same data and found the
published approach-3 constants inconsistent with approaches 1 and 2 (about 70 tokens per
parameter at Chinchilla's compute instead of 20). The replication is the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from anneal.errors import UserError

FIT_FORMAT = "anneal-chinchilla-fit"
FIT_VERSION = 1
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChinchillaFit:
    """``L(N, D) = E + A/N**alpha + B/D**beta``: N parameters, D tokens, L nats per token."""

    E: float
    """Irreducible loss in nats per token: no model size or data reaches below it."""
    A: float
    B: float
    alpha: float
    beta: float
    name: str
    source: str
    """Where the constants come from (a paper or a fit file)."""
    ci95: tuple[tuple[str, float, float], ...] = ()
    """Bootstrap 95% intervals as (parameter, low, high), for fits made by ``anneal fit``."""

    def __post_init__(self) -> None:
        bad = [
            k for k in PARAM_NAMES if not (math.isfinite(getattr(self, k)) and getattr(self, k) > 0)
        ]
        if bad:
            raise UserError(
                f"fit {self.name!r} ({self.source}): {', '.join(bad)} must be positive and "
                f"finite, got {', '.join(f'{k}={getattr(self, k)}' for k in bad)}. A fit "
                f"with a non-positive exponent has no compute-optimal frontier; it usually "
                f"means the runs span too little of N or D. Add runs of more sizes and token "
                f"budgets and fit again."
            )

    @property
    def a(self) -> float:
        """Exponent of N* in C: ``beta / (alpha + beta)``."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D* in C: ``alpha / (alpha + beta)``."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:  # noqa: N802 (the paper's name)
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def loss(self, params: float, tokens: float) -> float:
        """Predicted loss in nats per token of N = ``params`` trained on D = ``tokens``."""
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def optimal_params(self, flops: float) -> float:
        """Compute-optimal N for C = ``flops``: ``G (C/6)**a``."""
        return self.G * (flops / 6) ** self.a

    def optimal_tokens(self, flops: float) -> float:
        """Compute-optimal D for C = ``flops``: ``(C/6)**b / G`` (so that 6 N* D* = C)."""
        return (flops / 6) ** self.b / self.G

    def frontier_params_for_loss(self, loss: float) -> float:
        """N on the compute-optimal frontier where the predicted loss is ``loss``."""
        self.check_reachable(loss)
        return (self.A * (1 + self.alpha / self.beta) / (loss - self.E)) ** (1 / self.alpha)

    def check_reachable(self, loss: float) -> None:
        if not math.isfinite(loss):
            raise UserError(
                f"--target-loss {loss}: not a finite number. Give the final loss you want in "
                f"nats/token, above the {self.name} fit's irreducible E = {self.E:.4f} (e.g. "
                f"--target-loss {self.E + 0.5:.2f})."
            )
        if loss <= self.E:
            raise UserError(
                f"--target-loss {loss}: impossible under the {self.name} fit, whose "
                f"irreducible loss is E = {self.E:.4f} nats/token; no model size or amount "
                f"of data reaches it. Ask for a loss above {self.E:.4f}."
            )

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in PARAM_NAMES}
        out.update(name=self.name, source=self.source)
        if self.ci95:
            out["ci95"] = {k: [lo, hi] for k, lo, hi in self.ci95}
        return out


FITS: dict[str, ChinchillaFit] = {
    "hoffmann": ChinchillaFit(
        E=1.69,
        A=406.4,
        B=410.7,
        alpha=0.34,
        beta=0.28,
        name="hoffmann",
        source="Hoffmann et al. 2022, approach 3 (eq. 10)",
    ),
    "epoch": ChinchillaFit(
        E=1.8169,
        A=482.01,
        B=2085.43,
        alpha=0.3478,
        beta=0.3659,
        name="epoch",
        source="Besiroglu et al. 2024 (Epoch AI), replication of approach 3",
    ),
}
DEFAULT_FIT = "epoch"


def load_fit(name_or_path: str | Path) -> ChinchillaFit:
    """A shipped fit by name (``epoch``, ``hoffmann``) or a fit file written by ``anneal fit``."""
    if str(name_or_path) in FITS:
        return FITS[str(name_or_path)]
    path = Path(name_or_path)
    where = f"--fit {name_or_path}"
    if not path.is_file():
        raise UserError(
            f"{where}: neither a shipped fit ({', '.join(FITS)}) nor a file. Pass a fit name "
            f"or the JSON that `anneal fit` writes."
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(
            f"{where}: not a fit file (cannot read it as JSON: {e}). Fit files are the JSON "
            f"that `anneal fit` writes."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FIT_FORMAT:
        raise UserError(
            f'{where}: not a fit file (it has no "format": "{FIT_FORMAT}"). Fit files are '
            f"the JSON that `anneal fit` writes; shipped fits are named {', '.join(FITS)}."
        )
    if doc.get("version") != FIT_VERSION:
        raise UserError(
            f"{where}: fit file version {doc.get('version')!r}; this Anneal reads version "
            f"{FIT_VERSION}. Refit with `anneal fit`."
        )
    values = {}
    for k in PARAM_NAMES:
        v = doc.get("fit", {}).get(k) if isinstance(doc.get("fit"), dict) else None
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise UserError(
                f"{where}: fit file lacks a number for fit.{k}; it needs E, A, B, alpha and "
                f"beta. Refit with `anneal fit`."
            )
        values[k] = float(v)
    ci = doc.get("ci95") or {}
    return ChinchillaFit(
        **values,
        name=path.name,
        source=f"{path} ({len(doc.get('points', []))} runs)",
        ci95=tuple((k, float(ci[k][0]), float(ci[k][1])) for k in PARAM_NAMES if k in ci),
    )
