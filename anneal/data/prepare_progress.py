"""The progress line of ``anneal data prepare``'s tokenize+pack phase (one node, or one task
of a preparation split into tasks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """MB read, MB/s and tokens on stderr: a tqdm bar on a terminal, else a plain line every
    10 s and one at the end, so logs stay readable."""

    def __init__(self, total_bytes: int | None, *, enabled: bool, workers: int):
        self.total = total_bytes
        self.enabled = enabled
        self.workers = workers
        self.start = time.time()
        self.done = 0
        self.tokens = 0
        self._last = self.start
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                desc="tokenize+pack",
                disable=False,  # a terminal: drawn whatever TQDM_DISABLE says (anneal/__init__)
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=sys.stderr,
                dynamic_ncols=True,
                postfix=f"0 tokens, {workers} workers",
            )

    def update(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens:,} tokens, {self.workers} workers", False)
            self._bar.update(nbytes)
            return
        now = time.time()
        if self.enabled and now - self._last >= 10.0:
            self._last = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        dt = max(time.time() - self.start, 1e-9)
        total = f"/{self.total / 1e6:,.1f}" if self.total else ""
        pct = f" {100 * self.done / self.total:3.0f}%" if self.total else ""
        return (
            f"tokenize+pack{pct} {self.done / 1e6:,.1f}{total} MB | "
            f"{self.done / 1e6 / dt:,.1f} MB/s ({self.workers} workers) | "
            f"{self.tokens:,} tokens | {dt:,.1f} s"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(self.line(), file=sys.stderr, flush=True)
