"""The `anneal` CLI's contract for the planning commands (plan, fit, estimate).

Proves that every default these commands give argparse is the library's own (a parameter
default of `planning.plan` / `planning.fit_points` or a module constant), so that the CLI and the
library cannot drift apart again (the bootstrap count once was 100 in one and 200 in the other),
and that `main()` turns only `UserError` into `anneal <cmd>: error: ...` and exit 2 while any
other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import inspect

import pytest

from anneal import cli, hardware, planning
from anneal.cli import planning as planning_commands
from anneal.planning import memory


def signature_default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


# (command, argparse dest) -> the library's default it must equal.
LIBRARY_DEFAULTS = {
    ("plan", "gpu"): signature_default(planning.plan, "gpu"),
    ("plan", "global_batch"): signature_default(planning.plan, "global_batch"),
    ("plan", "fit"): planning.DEFAULT_FIT,
    ("fit", "bootstrap"): signature_default(planning.fit_points, "n_bootstrap"),
    ("fit", "starts"): signature_default(planning.fit_points, "grid_starts"),
    ("fit", "seed"): signature_default(planning.fit_points, "seed"),
    ("estimate", "gpu"): hardware.DEFAULT_GPU,
    ("estimate", "nodes"): memory.DEFAULT_NODES,
    ("estimate", "gpus_per_node"): memory.DEFAULT_GPUS_PER_NODE,
}
# Defaults with no library counterpart: where the CLI writes its own output.
CLI_ONLY = {("fit", "out"): "scaling_fit.json"}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("plan", "fit", "estimate")}


def test_every_planning_default_is_the_librarys():
    seen = set()
    for command, parser in subparsers().items():
        for action in parser._actions:
            if action.dest in ("help", "func") or isinstance(action, argparse._StoreTrueAction):
                continue
            key = (command, action.dest)
            if key in LIBRARY_DEFAULTS:
                assert action.default == LIBRARY_DEFAULTS[key], key
                seen.add(key)
            elif key in CLI_ONLY:
                assert action.default == CLI_ONLY[key], key
            else:  # a new default must be added to LIBRARY_DEFAULTS, with its library home
                assert action.default is None, (key, action.default)
    assert seen == set(LIBRARY_DEFAULTS)


def test_library_defaults_agree_with_each_other():
    assert signature_default(planning.plan, "gpu") == hardware.DEFAULT_GPU
    assert signature_default(planning.plan, "global_batch") == planning.DEFAULT_GLOBAL_BATCH
    assert planning.DEFAULT_FIT in planning.FITS and hardware.DEFAULT_GPU in hardware.GPUS


def test_help_shows_the_defaults_in_use():
    parsers = subparsers()
    fit_help = " ".join(parsers["fit"].format_help().split())  # unwrapped
    n_bootstrap = signature_default(planning.fit_points, "n_bootstrap")
    assert f"bootstrap resamples (default {n_bootstrap})" in fit_help
    assert "default all 4500" in fit_help
    plan_help = " ".join(parsers["plan"].format_help().split())
    assert f"(default {hardware.DEFAULT_MFU['cuda']})" in plan_help
    assert f"(default {planning.DEFAULT_GLOBAL_BATCH})" in plan_help
    assert memory.DEFAULT_DS_CONFIG in parsers["estimate"].format_help().replace("\n", "")


def test_main_reports_a_user_error_in_one_line_and_exits_2(capsys):
    assert cli.main(["plan", "--flops", "1e21", "--gpu", "tpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("anneal plan: error: --gpu tpu: unknown GPU")
    assert "Traceback" not in err


@pytest.mark.parametrize("exc", [ValueError("an internal invariant"), KeyError("a bug")])
def test_main_lets_any_other_exception_keep_its_traceback(monkeypatch, exc):
    def broken(args):
        raise exc

    monkeypatch.setattr(planning_commands, "_plan", broken)
    with pytest.raises(type(exc)):
        cli.main(["plan", "--flops", "1e21"])
