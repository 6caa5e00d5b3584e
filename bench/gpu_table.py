"""What the GPU benchmark prints and leaves: the header (device, versions, how MFU is counted),
the markdown table of the rows, the sentence that reads it against the 45% MFU goal and
llm-foundry's figure, the fragment for docs/benchmarks.md and the closing JSON line.

Pure formatting of result lines; nothing here runs a process.
"""

from __future__ import annotations

H100_H200_PEAK = 989e12
"""Dense bf16 peak of the H100 and H200 SXM, FLOP/s (what the issue measures MFU against)."""
GOAL_MFU = 0.45
LLM_FOUNDRY_1B_MFU = 0.418
"""llm-foundry's published MFU for its 1B model on H100 (its README's throughput table)."""

OPTIMIZER_NAMES = {
    "torch-foreach": "torch AdamW (foreach)",
    "torch-fused": "torch AdamW (fused)",
    "ds-fused": "DeepSpeed FusedAdam",
    "muon": "Muon (DeepSpeed MuonWithAuxAdam)",
}
SUMMARY_KEYS = ("name", "status", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "reason")
"""A row's keys in the closing JSON line."""


def _fmt(value, spec: str, missing: str = "-") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else missing


def table(results: list[dict]) -> str:
    lines = [
        "| row | model | ZeRO | act. ckpt | seq | loss | optimizer | precision | micro x accum "
        "| tokens/s | TFLOP/s | MFU | peak mem GiB | step s | first step s | status |",
        "|---|---|---:|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        status = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        status = status.replace("|", "/")
        accum = r.get("accum")
        lines.append(
            f"| {r['name']} | {r['preset']} | {r['zero']} | {'on' if r['ckpt'] else 'off'} "
            f"| {r['seq_len']} | {r.get('loss', '-')} "
            f"| {OPTIMIZER_NAMES.get(r['optimizer'], r['optimizer'])} | {r['precision']} "
            f"| {r['micro']} x {accum if accum is not None else '?'} "
            f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('tflops'), '.1f')} "
            f"| {_fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}{'%' if r.get('mfu') else ''} "
            f"| {_fmt(r.get('peak_mem_gib'), '.1f')} | {_fmt(r.get('step_s'), '.2f')} "
            f"| {_fmt(r.get('first_step_s'), '.0f')} | {status} |"
        )
    return "\n".join(lines)


def reading(results: list[dict], *, cpu: bool) -> str:
    ok = [r for r in results if r["status"] == "ok"]
    failed = [r["name"] for r in results if r["status"] not in ("ok", "skipped")]
    parts = []
    if cpu:
        parts.append(
            "CPU smoke of the GPU benchmark's code path (tiny preset, fp32, ds_configs/cpu.json); "
            "MFU is against this CPU's measured fp32 peak and means nothing for GPUs."
        )
    # llm-foundry's figure is at sequence 2048; the 32K rows are read against their twins.
    one_b = [r for r in ok if r["preset"] == "1b" and r["seq_len"] == 2048]
    if one_b:
        best = max(one_b, key=lambda r: r["mfu"])
        verdict = "meets" if best["mfu"] >= GOAL_MFU else "misses"
        parts.append(
            f"Best 1b row: {best['name']} at {100 * best['mfu']:.1f}% MFU "
            f"({best['tflops']:.0f} TFLOP/s, {best['tokens_per_s']:,.0f} tokens/s), which "
            f"{verdict} the {100 * GOAL_MFU:.0f}% goal (llm-foundry: "
            f"{100 * LLM_FOUNDRY_1B_MFU:.1f}% for 1B on H100)."
        )
    parts += loss_pairs(ok)
    parts += mask_pairs(ok)
    parts += muon_pairs(ok)
    parts += save_pairs(ok)
    parts += throughput_pairs(ok)
    parts += sparse_rows(ok)
    if failed:
        parts.append(f"Rows that did not finish: {', '.join(failed)} (reasons in the table).")
    if not ok:
        parts.append("No row was measured.")
    return " ".join(parts)


def sparse_rows(ok: list[dict]) -> list[str]:
    """What a measured sparse row's MFU counts: its active parameters, not its total."""
    return [
        f"{r['name']}: MoE through AutoEP; its MFU counts the {r['active_params'] / 1e9:.2f}B "
        f"parameters a token runs through, of {r['params'] / 1e9:.2f}B."
        for r in ok
        if r.get("active_params") and r.get("params") and r["active_params"] < r["params"]
    ]


def twins(ok: list[dict], suffix: str, differs) -> list[tuple[dict, dict]]:
    """(variant, base) for each measured row for which ``differs(row)`` holds and whose base, its
    name less ``suffix``, was measured too: the rows that differ from their twin in one thing."""
    by_name = {r["name"]: r for r in ok}
    pairs = [(r, by_name.get(r["name"].removesuffix(suffix))) for r in ok if differs(r)]
    return [(variant, base) for variant, base in pairs if base is not None and base is not variant]


def loss_pairs(ok: list[dict]) -> list[str]:
    """What the chunked loss saves against the plain one, for each measured pair of rows that
    differ only in the loss (``NAME`` and ``NAME-plainloss``)."""
    parts = []
    for plain, chunked in twins(ok, "-plainloss", lambda r: r.get("loss") == "plain"):
        saved = plain["peak_mem_gib"] - chunked["peak_mem_gib"]
        speed = chunked["tokens_per_s"] / plain["tokens_per_s"]
        parts.append(
            f"Chunked loss against plain at sequence {chunked['seq_len']} ({chunked['name']}): "
            f"peak {chunked['peak_mem_gib']:.1f} GiB against {plain['peak_mem_gib']:.1f} GiB "
            f"({saved:+.1f} GiB saved), {chunked['tokens_per_s']:,.0f} against "
            f"{plain['tokens_per_s']:,.0f} tokens/s ({100 * (speed - 1):+.1f}%)."
        )
    return parts


def mask_pairs(ok: list[dict]) -> list[str]:
    """What document masking costs, for each measured pair of rows that differ only in it
    (``NAME`` and ``NAME-docmask``)."""
    parts = []
    for masked, plain in twins(ok, "-docmask", lambda r: bool(r.get("document_mask"))):
        speed = masked["tokens_per_s"] / plain["tokens_per_s"]
        parts.append(
            f"Document masking at sequence {plain['seq_len']} ({masked['name']}, attention "
            f"{masked.get('attention', '?')}): "
            f"{masked['tokens_per_s']:,.0f} against {plain['tokens_per_s']:,.0f} tokens/s "
            f"({100 * (speed - 1):+.1f}%; goal: at most 4% slower with a varlen kernel), peak "
            f"{masked['peak_mem_gib']:.1f} against {plain['peak_mem_gib']:.1f} GiB."
        )
    return parts


def muon_pairs(ok: list[dict]) -> list[str]:
    """What Muon costs a step against AdamW, for each measured pair of rows that differ only in
    the optimizer (``NAME`` and ``NAME-muon``)."""
    parts = []
    for muon, adamw in twins(ok, "-muon", lambda r: r.get("optimizer") == "muon"):
        step = adamw["tokens_per_s"] / muon["tokens_per_s"]  # equal tokens a step
        parts.append(
            f"Muon against AdamW at {adamw['name']}'s shape: {muon['tokens_per_s']:,.0f} against "
            f"{adamw['tokens_per_s']:,.0f} tokens/s (Muon's step {step:.2f}x AdamW's; goal: at "
            f"most 1.10x), peak {muon['peak_mem_gib']:.1f} against "
            f"{adamw['peak_mem_gib']:.1f} GiB."
        )
    return parts


def save_pairs(ok: list[dict]) -> list[str]:
    """What a save costs the training, synchronous against asynchronous, for each measured pair
    of save rows (``NAME-syncsave`` and ``NAME-asyncsave``)."""
    by_name = {r["name"]: r for r in ok}
    parts = []
    for asyn in ok:
        sync = by_name.get(asyn["name"].replace("-asyncsave", "-syncsave"))
        if not asyn.get("async_save") or sync is None or sync.get("save_blocking_s") is None:
            continue
        write = asyn.get("save_write_s")
        parts.append(
            f"A save at {sync['name'].removesuffix('-syncsave')}'s shape: the loop waited "
            f"{sync['save_blocking_s']:.2f} s synchronous against "
            f"{_fmt(asyn.get('save_blocking_s'), '.2f')} s asynchronous (its write "
            f"{_fmt(write, '.2f')} s behind the training); in the steps themselves "
            f"{asyn['tokens_per_s']:,.0f} against {sync['tokens_per_s']:,.0f} tokens/s (a "
            f"synchronous save waits between steps, in its blocking time only)."
        )
    return parts


THROUGHPUT_TWINS = (
    # (suffix, the setting in words, the suffix of the row it is read against, the goal)
    ("-compile", "torch.compile", "", "goal at the 1b shape: +10%"),
    ("-compile-float8", "torch.compile + float8", "", ""),
    ("-compile-float8", "torch.compile + float8", "-compile", "goal at the 8B-like shape: +20%"),
    ("-deepcompile", "DeepCompile", "", ""),
)
"""The throughput rows (bench/gpu_throughput.py) by suffix: each is read against the row that
its name less the suffix, plus the second suffix, names (none: the eager row)."""


def throughput_pairs(ok: list[dict]) -> list[str]:
    """What compile, float8 and DeepCompile give, for each measured throughput row whose twin was
    measured (docs/throughput.md): tokens/s, MFU, the loss after the same steps (against eager
    bf16, the issue's goal: within 1%) and the seconds the run spent compiling."""
    by_name = {r["name"]: r for r in ok}
    parts = []
    for suffix, words, against, goal in THROUGHPUT_TWINS:
        for r in ok:
            shape = r["name"].removesuffix(suffix)
            base = by_name.get(shape + against)
            if shape == r["name"] or base is None or "last_loss" not in r:
                continue
            speed = r["tokens_per_s"] / base["tokens_per_s"] - 1
            loss = r["last_loss"] / base["last_loss"] - 1
            loss_goal = "" if against else "; goal: within 1%"
            parts.append(
                f"{words} against {'compile' if against else 'eager'} at {shape}'s shape: "
                f"{r['tokens_per_s']:,.0f} against {base['tokens_per_s']:,.0f} tokens/s "
                f"({100 * speed:+.1f}%{'; ' + goal if goal else ''}), MFU {100 * r['mfu']:.1f}% "
                f"against {100 * base['mfu']:.1f}%, loss after step {r['last_step']} "
                f"{r['last_loss']:.4f} against {base['last_loss']:.4f} ({100 * loss:+.2f}%"
                f"{loss_goal}); {_fmt(r.get('compile_s'), '.0f')} s compiling."
            )
    return parts


def header(info: dict, results: list[dict], *, cpu: bool) -> str:
    """The paragraph above the table: device, versions and how the figures were taken."""
    versions = (
        f"torch {info.get('torch')} (CUDA {info.get('torch_cuda')}), "
        f"DeepSpeed {str(info.get('deepspeed')).split()[0]}, "
        f"transformers {str(info.get('transformers')).split()[0]}, Python {info.get('python')}"
    )
    peaks = sorted({r["peak_flops"] for r in results if r.get("peak_flops")})
    peak = info.get("peak_flops") or (peaks[0] if peaks else None)
    seqs = sorted({r["seq_len"] for r in results})
    text = (
        f"Device: {info.get('device', '?')}; {versions}. Sequence {', '.join(map(str, seqs))}; "
        f"SDPA attention (flash kernel: {info.get('sdpa_flash', 'n/a')}). MFU = (6N + "
        f"12*L*H*Q*T) x tokens/s / peak (N: a sparse model's active parameters), peak "
        f"{_fmt(peak and peak / 1e12, ',.4g')} TFLOP/s"
        f"{' (measured fp32 matmul rate of this CPU)' if cpu else ' (dense bf16)'}; tokens/s is "
        f"the median of the measured steps after the warmup steps; peak memory is torch's peak "
        f"allocated."
    )
    if not cpu and peaks and peaks != [peak]:
        text += f" Warning: the runs divided by peaks {peaks}, not {peak}."
    return text


def report_fragment(device: str, text: str, *, cpu: bool) -> str:
    """The section for docs/benchmarks.md: a heading, the command, then ``text``."""
    cmd = "bash bench/gpu.sh " + ("--cpu-smoke " if cpu else "") + "LOGDIR"
    return f"### GPU: 1b and 125m on one {device} (`bench/gpu.sh`)\n\n```\n{cmd}\n```\n\n{text}\n"


def summary(results: list[dict], *, cpu: bool, device: str, logdir: str) -> dict:
    """The closing JSON line (``bench/run_all.py`` and the tests read it)."""
    return {
        "bench": "gpu",
        "cpu_smoke": cpu,
        "device": device,
        "logdir": logdir,
        "rows": [{k: r.get(k) for k in SUMMARY_KEYS} for r in results],
    }
