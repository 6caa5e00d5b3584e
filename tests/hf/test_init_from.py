"""Continued pretraining from a Hugging Face model directory (``--init-from DIR``,
``anneal.hf.load`` and ``anneal.hf.load_weights``).

Tiny Llama, Qwen2 (tied embeddings, an embedding padded past the tokenizer's ids) and Mistral
(bf16 weights, a sliding window shorter than the context) models are made here with
``save_pretrained`` after two plain-torch AdamW steps, so their weights are not at init, beside
the tokenizer their data is prepared with (``prepare(tokenizer=DIR)``, what ``anneal data
prepare --tokenizer DIR`` runs). Checked against plain transformers (``from_pretrained`` on the
same directory, cross-entropy on the same validation windows): Anneal's validation loss at step
0, before any update, through the real DeepSpeed engine, within 1e-5 relative in fp32, each
architecture at one ZeRO stage in this process (every stage, and 2 ranks, in the slow test);
each bad input is one UserError naming the fix, before any weight is read; ``.bin`` weights
load as the safetensors do. The slow test trains each model two steps with the recipe, exports
it with ``anneal export`` and checks that ``from_pretrained`` gives exactly the checkpoint's
logits.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401 - at collection, as the suite's other model tests do

from anneal.errors import UserError
from tests.conftest import ROOT, env, launch, run_process

VOCAB = 300  # the tokenizer's ids (tiny_data's byte-level vocabulary)
SEQ = 64
EVAL_WINDOWS = 8
ARCHS = {
    "llama": dict(vocab_size=VOCAB, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=320, rope_theta=1e6, tie_word_embeddings=True),
    "mistral": dict(vocab_size=VOCAB, sliding_window=48, tie_word_embeddings=False),
}
"""Qwen2's releases pad the embedding past the tokenizer's ids (151,936 rows for 151,646 ids);
the Mistral one is saved in bf16 and cast to fp32 on load."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_model(kind: str, out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A tiny ``kind`` model after two AdamW steps on random ids, saved with its tokenizer."""

    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{cls}Config")(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **ARCHS[kind],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (4, 33))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    if kind == "mistral":
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {kind: make_model(kind, root / kind, tiny_data) for kind in ARCHS}


@pytest.fixture(scope="module")
def model_data(tmp_path_factory, models) -> dict[str, Path]:
    """A corpus prepared with each model's tokenizer (``--tokenizer DIR``): transformers loads
    the same tokenizer files as another class in a Qwen2 directory (Qwen2Tokenizer: NFC and its
    own pre-tokenizer), so data prepared from the Llama directory has other ids for it. The
    tokenizer is installed in this process (``_in_child`` runs it here), as
    tests/data/test_data_bad_input.py does: a fresh interpreter importing transformers again takes
    seconds."""
    from anneal.data import make_tokenizer
    from anneal.data.prepare import prepare

    src = tmp_path_factory.mktemp("init_src") / "text.txt"
    src.write_text(
        "\n\n".join(f"doc {i}: " + f"the {i % 7} quick brown fox jumps " * 30 for i in range(120))
    )
    out = tmp_path_factory.mktemp("init_data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(make_tokenizer, "_in_child", lambda fn, *args: fn(*args))
        for kind, directory in models.items():
            prepare(
                inputs=[str(src)],
                out=out / kind,
                tokenizer=directory,
                val_fraction=0.2,
                workers=1,
                progress=False,
            )
    return {kind: out / kind for kind in models}


def recipe_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--init-from",
        str(model_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--set",
        f"model.seq_len={SEQ}",
        "--set",
        f"train.val_samples={EVAL_WINDOWS}",
        "--set",
        f"optim.global_batch_tokens={8 * SEQ}",
        "--set",
        "train.precision=fp32",
        *extra,
    ]


def config(model_dir: Path, data: Path, out: Path, *extra: str):
    from anneal.cli.recipe import config_from_args

    return config_from_args(
        recipe_args(model_dir, data, out, *extra),
        prog="recipes/continue_pretraining.py",
        preset="tiny",
        ds_config="cpu.json",
    )


def resolve(model_dir: Path, data: Path, out: Path, *extra: str):
    from anneal.resolution.resolve import resolve_launch

    cfg, overrides = config(model_dir, data, out, *extra)
    return resolve_launch(cfg, overrides, world_size=1, device_type="cpu")


# --- step 0 against plain transformers ---------------------------------------------------------


def anneal_step0(model_dir: Path, data: Path, out: Path, stage: int) -> float:
    """Anneal's validation loss before any update: the recipe's resolution, the engine as
    training builds it (ZeRO ``stage``) and the validation pass of the loop."""
    from anneal.train import build_engine, resolve_run, validate
    from anneal.train.trainer import Data

    cfg, overrides = config(model_dir, data, out, "--set", f"ds.zero_optimization.stage={stage}")
    launch = resolve_run(cfg, overrides)
    engine = build_engine(launch)
    d = Data.open(launch)
    n, micro = launch.cfg.train.val_samples, launch.micro_batch
    return validate(engine, d.val, d.token_bytes, n_samples=n, micro_batch=micro)["val_loss"]


@torch.no_grad()
def transformers_loss(model_dir: Path, data: Path) -> float:
    """Plain transformers on the same windows: the val split's EVAL_WINDOWS windows spread
    evenly over it (t * n // EVAL_WINDOWS), mean cross-entropy of every next token."""
    from transformers import AutoModelForCausalLM

    from anneal.data.stream import PackedSplit

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    val = PackedSplit(data, "val", seq_len=SEQ)
    windows = [val.window(t * val.n_windows // EVAL_WINDOWS) for t in range(EVAL_WINDOWS)]
    ids = torch.stack([torch.as_tensor(w.astype("int64")) for w in windows])
    logits = model(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).item()


@pytest.mark.parametrize("kind, stage", [("llama", 1), ("mistral", 2), ("qwen2", 3)])
def test_step0_validation_equals_transformers(
    world_of_one, models, model_data, tmp_path, kind, stage
):
    ours = anneal_step0(models[kind], model_data[kind], tmp_path / "run", stage)
    theirs = transformers_loss(models[kind], model_data[kind])
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert abs(ours - math.log(VOCAB)) > 0.01  # trained weights, not the near-uniform init
    assert not (tmp_path / "run").exists()  # nothing written before the loop


def test_the_model_is_the_checkpoints_and_its_source_is_recorded(models, model_data, tmp_path):
    import hashlib

    launch = resolve(models["qwen2"], model_data["qwen2"], tmp_path / "run")
    preset = launch.preset
    assert preset.hf_config["model_type"] == "qwen2" and preset.hf_config["tie_word_embeddings"]
    assert preset.hf_config["max_position_embeddings"] == 128 and preset.seq_len == SEQ
    assert preset.vocab_size == 320 and launch.meta["vocab_size"] == VOCAB
    assert preset.rope_theta == 1e6
    weights = models["qwen2"] / "model.safetensors"
    doc = launch.config_document()
    assert doc["model"]["init_from"]["files"] == {
        "model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()
    }
    assert doc["run"]["model"]["init_from"] == str(models["qwen2"])
    from transformers import AutoModelForCausalLM

    n = AutoModelForCausalLM.from_pretrained(str(models["qwen2"])).num_parameters()
    assert doc["model"]["params"] == n  # the tied matrix once, the q/k/v biases counted


def test_a_longer_context_says_rope_is_not_rescaled(models, model_data, tmp_path, caplog):
    caplog.set_level("INFO", logger="anneal.hf.load")
    resolve(models["llama"], model_data["llama"], tmp_path / "run", "--set", "model.seq_len=256")
    assert "the recipe's preset 'tiny' is not used" in caplog.text
    assert "longer than the checkpoint's max_position_embeddings 128" in caplog.text
    assert "not rescaled" in caplog.text


@pytest.mark.parametrize("device, world", [("cpu", 1), ("cuda", 8)])
def test_the_recipe_resolves_with_its_defaults(models, model_data, tmp_path, device, world):
    """recipes/continue_pretraining.py as shipped, on the CPU path and on an 8-GPU node: the
    checkpoint's context, a tenth of Llama 2's peak LR, WSD with a 20% (1 - sqrt) cooldown to
    0, a warmup of 1% of the run, 4M tokens a step. Without --init-from it says to give it."""
    from anneal.cli.recipe import config_from_args, load_recipe
    from anneal.resolution.resolve import resolve_launch

    spec = load_recipe(ROOT / "recipes" / "continue_pretraining.py")
    data = ["--data", str(model_data["llama"]), "--out", str(tmp_path / "run")]
    argv = ["--init-from", str(models["llama"]), *data]
    cfg, overrides = config_from_args(argv, prog="c", on_cpu=device == "cpu", **spec)
    launch = resolve_launch(cfg, overrides, world_size=world, device_type=device)
    schedule = launch.schedule
    assert launch.seq_len == 128 and launch.preset.hf_config["model_type"] == "llama"
    assert launch.ds_config["optimizer"]["params"]["lr"] == 3e-5
    assert launch.ds_config["train_batch_size"] * launch.seq_len == 2**22
    assert (schedule.kind, schedule.decay_share, schedule.decay_shape) == ("wsd", 0.2, "1-sqrt")
    assert schedule.min_ratio == 0.0 and schedule.total_num_steps == 2400
    assert schedule.warmup_num_steps == 24  # 1% of the run (100M tokens would be 24 steps too)
    assert launch.bf16 is (device == "cuda")
    assert launch.describe().startswith(f"model {models['llama']}: ")  # not "model pretrained"
    cfg, overrides = config_from_args(data, prog="c", on_cpu=device == "cpu", **spec)
    with pytest.raises(UserError, match="Give --init-from DIR"):
        resolve_launch(cfg, overrides, world_size=world, device_type=device)


# --- bad inputs: one UserError each, before any weight is read ---------------------------------


def _copy(models, tmp_path, kind: str = "llama") -> Path:
    return Path(shutil.copytree(models[kind], tmp_path / f"{kind}_copy"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _edit_config(d, model_type="llama9"), "transformers does not know"),
        (lambda d: _edit_config(d, model_type="gpt2"), "not verified with Anneal"),
        (shutil.rmtree, "no such directory"),
        (lambda d: (d / "config.json").unlink(), "holds no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "holds no weights"),
        (lambda d: _edit_config(d, dtype="int8"), "no floating-point torch dtype"),
        (lambda d: _edit_config(d, quantization_config={"quant_method": "gptq"}), "quantized"),
        (lambda d: _edit_config(d, vocab_size=256), "ids 256 and up have no embedding"),
    ],
    ids=[
        "unknown",
        "unverified",
        "no-directory",
        "no-config",
        "no-weights",
        "dtype",
        "quantized",
        "rows",
    ],
)
def test_bad_directory_is_one_clear_error(models, model_data, tmp_path, damage, message):
    directory = _copy(models, tmp_path)
    damage(directory)
    with pytest.raises(UserError, match=message) as e:
        resolve(directory, model_data["llama"], tmp_path / "run")
    assert e.value.every_rank and f"--init-from {directory}" in str(e.value)


def test_truncated_and_missing_weight_files_are_refused(models, model_data, tmp_path):
    directory = _copy(models, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(UserError, match="a truncated copy"):
        resolve(directory, model_data["llama"], tmp_path / "run")
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}'
    weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(UserError, match="is not a safetensors file"):
        resolve(directory, model_data["llama"], tmp_path / "run")
    weights.rename(directory / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"not there \(model-00002-of-00002.safetensors\)"):
        resolve(directory, model_data["llama"], tmp_path / "run")


def test_integer_weights_cannot_be_cast(models, model_data, tmp_path):
    from safetensors.torch import save_file

    directory = _copy(models, tmp_path)
    save_file(
        {"model.embed_tokens.weight": torch.zeros(VOCAB, 64, dtype=torch.int8)},
        str(directory / "model.safetensors"),
    )
    with pytest.raises(UserError, match="dtype I8, which cannot be cast"):
        resolve(directory, model_data["llama"], tmp_path / "run")


@pytest.mark.parametrize("kind, data", [("llama", "tiny_data"), ("qwen2", "llama")])
def test_data_of_another_tokenizer_is_refused(models, model_data, tiny_data, tmp_path, kind, data):
    """Refused by the tokenizer's hash, the vocabulary sizes being equal: tiny_data was
    tokenized by its own SentencePiece files, not prepared from the model's directory; and the
    Llama directory's data has other ids than the Qwen2 directory's tokenizer gives."""
    from anneal.train import resolve_run

    data_dir = tiny_data if data == "tiny_data" else model_data[data]
    cfg, overrides = config(models[kind], data_dir, tmp_path / "run")
    with pytest.raises(UserError, match="its tokenizer is not the one --data") as e:
        resolve_run(cfg, overrides)
    assert "anneal data prepare --tokenizer" in str(e.value)


def test_the_launchers_preflight_refuses_data_of_another_tokenizer(
    models, tiny_data, tmp_path, capsys
):
    """Issue 33: the launcher's pre-flight (``python -m launcher run``, on the launch host,
    before any rank starts or Slurm allocates) refuses --init-from with data of another
    tokenizer, with the rank's own message and exit 2, where it printed the command to start."""
    from launcher.__main__ import main as launcher_main

    out = tmp_path / "run"
    argv = ["run", "recipes/continue_pretraining.py", "--num-gpus", "1", "--device", "cpu"]
    argv += ["--dry-run", "--", *recipe_args(models["llama"], tiny_data, out)]
    assert launcher_main([*argv, "--ds-config", "cpu.json"]) == 2
    err = capsys.readouterr().err
    assert "its tokenizer is not the one --data" in err
    assert "anneal data prepare --tokenizer" in err and not out.exists()


def test_a_shape_override_or_an_empty_flag_is_refused(models, model_data, tmp_path):
    with pytest.raises(UserError, match="shape of a pretrained model is its config.json's"):
        resolve(
            models["llama"], model_data["llama"], tmp_path / "r", "--set", "model.hidden_size=128"
        )
    from anneal.cli.recipe import config_from_args

    with pytest.raises(UserError, match="--init-from is empty"):
        config_from_args(["--init-from", " "], prog="r", preset="tiny", ds_config="cpu.json")


def test_weights_of_another_shape_are_refused_before_any_is_copied(models, model_data, tmp_path):
    """The launch refuses a config.json the weight headers contradict, naming the key; and
    the loader itself, given a model of another shape, refuses before copying any tensor."""
    import dataclasses

    from anneal import model as modellib
    from anneal.hf.load_weights import load_pretrained_

    directory = _copy(models, tmp_path)
    preset = resolve(directory, model_data["llama"], tmp_path / "run").preset
    _edit_config(directory, num_hidden_layers=3)
    with pytest.raises(UserError, match="config.json gives num_hidden_layers 3 and the weights"):
        resolve(directory, model_data["llama"], tmp_path / "run")
    three = dict(preset.hf_config, num_hidden_layers=3)
    model = modellib.build_model(dataclasses.replace(preset, hf_config=three))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(UserError, match=r"do not fit .*missing \['model.layers.2"):
        load_pretrained_(model, directory)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bin_weights_load_as_safetensors_do_and_code_in_them_is_refused(models, tmp_path):
    """A ``pytorch_model.bin`` (what save_pretrained wrote before safetensors) gives the same
    parameters; one whose pickle names another global is refused unopened."""
    from safetensors.torch import load_file

    from anneal import model as modellib
    from anneal.config.run import ModelConfig
    from anneal.hf.load import pretrained_preset
    from anneal.hf.load_weights import load_pretrained_

    directory = _copy(models, tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    preset = pretrained_preset(directory, data_vocab=VOCAB, model=ModelConfig(seq_len=SEQ))
    assert list(preset.init_from["files"]) == ["pytorch_model.bin"]
    model = modellib.build_model(preset)
    load_pretrained_(model, directory)
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())

    torch.save({"x": _Evil()}, directory / "pytorch_model.bin")
    with pytest.raises(UserError, match="could run code"):
        pretrained_preset(directory, data_vocab=VOCAB, model=ModelConfig(seq_len=SEQ))


def test_sharded_safetensors_load_as_one_file_does(models, tmp_path):
    """A release in shards (``model-0000k-of-0000n.safetensors`` and their index, as
    save_pretrained writes a large model) gives the same parameters as the single file."""
    from transformers import AutoModelForCausalLM

    from anneal import model as modellib
    from anneal.config.run import ModelConfig
    from anneal.hf.load import pretrained_preset
    from anneal.hf.load_weights import load_pretrained_

    original = AutoModelForCausalLM.from_pretrained(str(models["llama"]), dtype=torch.float32)
    directory = tmp_path / "sharded"
    original.save_pretrained(str(directory), max_shard_size="40KB")
    preset = pretrained_preset(directory, data_vocab=VOCAB, model=ModelConfig(seq_len=SEQ))
    assert len(preset.init_from["files"]) > 2
    model = modellib.build_model(preset)
    load_pretrained_(model, directory)
    want = dict(original.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


# --- slow: every stage on 2 ranks, training, and the export round trip -------------------------

TRAINED_AT = {"llama": 3, "qwen2": 2, "mistral": 1}
"""The ZeRO stage each model is trained at (two steps) before its export."""
TWO_RANKS = """
import json, sys
from pathlib import Path
from anneal.cli.recipe import config_from_args, load_recipe
from anneal.dist import init_distributed, rank, shutdown
from anneal.train import run
from tests.hf.test_init_from import TRAINED_AT, anneal_step0, recipe_args, transformers_loss

init_distributed(600)
pairs, out = json.loads(sys.argv[-2]), Path(sys.argv[-1])  # the last two: after any --local_rank
rows = []
for kind, (model_dir, data) in pairs.items():
    theirs = transformers_loss(Path(model_dir), Path(data)) if rank() == 0 else None
    for stage in (1, 2, 3):
        ours = anneal_step0(Path(model_dir), Path(data), out / f"{kind}{stage}", stage)
        rows.append([kind, stage, ours, theirs])
recipe = load_recipe("recipes/continue_pretraining.py")
for kind, (model_dir, data) in pairs.items():
    stage = f"ds.zero_optimization.stage={TRAINED_AT[kind]}"
    argv = recipe_args(Path(model_dir), Path(data), out / kind, "--max-steps", "2", "--set", stage)
    run(*config_from_args(argv, prog="recipes/continue_pretraining.py", on_cpu=True, **recipe))
if rank() == 0:
    print("ROWS " + json.dumps(rows))
shutdown()
"""


@pytest.fixture(scope="module")
def two_ranks(models, model_data, tmp_path_factory) -> dict:
    """One launch of 2 ranks (tests/scripts/ranks.py) that computes each model's step-0
    validation loss at ZeRO-1, 2 and 3, then trains each two steps with the recipe's defaults
    (``recipes/continue_pretraining.py``: WSD, its LR) at the stage of ``TRAINED_AT``: the
    rows (kind, stage, Anneal's loss, transformers') and the run directories."""
    out = tmp_path_factory.mktemp("two_ranks")
    script = out / "two_ranks.py"
    script.write_text(TWO_RANKS)
    pairs = {k: [str(v), str(model_data[k])] for k, v in models.items()}
    env_ = {**env(), "OMP_NUM_THREADS": "1"}
    cmd = launch(2, str(script), json.dumps(pairs), str(out))
    proc = run_process(cmd, timeout_s=600, check=True, cwd=ROOT, env=env_)
    line = next(x for x in proc.stdout.splitlines() if "ROWS " in x)
    return {"rows": json.loads(line.split("ROWS ", 1)[1]), "out": out, "log": proc.stderr}


@pytest.mark.slow
def test_step0_every_stage_on_two_ranks(two_ranks):
    """The validation windows dealt to two ranks and summed equal transformers' loss on all of
    them, for each architecture at ZeRO-1, 2 and 3. Slow: with the fixture's training runs, one
    2-rank launch of about 40 s."""
    rows = two_ranks["rows"]
    assert sorted((kind, stage) for kind, stage, *_ in rows) == sorted(
        (kind, stage) for kind in ARCHS for stage in (1, 2, 3)
    )
    for kind, stage, ours, theirs in rows:
        assert ours == pytest.approx(theirs, rel=1e-5), (kind, stage)
    assert "the recipe's preset 'pretrained' is not used" in two_ranks["log"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ARCHS))
def test_trained_then_exported_gives_the_checkpoints_logits(two_ranks, models, kind):
    """After two steps on 2 ranks, ``anneal export --dtype fp32`` then ``from_pretrained``: its
    logits equal exactly those of the training model holding the checkpoint's weights (read by
    DeepSpeed's own consolidation), the config keeps the architecture, its context and its tied
    or untied embeddings, and the weights moved from the start. Slow: reads the 2-rank launch
    of ``two_ranks``; the export itself takes about 2 s."""
    from transformers import AutoModelForCausalLM

    from anneal import model as modellib
    from anneal.cli import main as cli_main
    from anneal.hf.source import preset_from_record
    from anneal.hf.zero import reference_state_dict
    from anneal.resilience.checkpoint import intact_checkpoints
    from anneal.rundir import read_record

    run, out = two_ranks["out"] / kind, two_ranks["out"] / f"{kind}-hf"
    assert cli_main(["export", str(run), "--out", str(out), "--dtype", "fp32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(exported).__name__.lower().startswith(kind)
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_position_embeddings"] == 128
    assert saved["tie_word_embeddings"] == ARCHS[kind]["tie_word_embeddings"]
    record = read_record(run)
    assert record.model["init_from"]["path"] == str(models[kind].resolve())
    ref = modellib.build_model(preset_from_record(record)).eval()
    sd = reference_state_dict(intact_checkpoints(run / "checkpoints")[-1], TRAINED_AT[kind])
    ref.load_state_dict(sd, strict=True)
    start = AutoModelForCausalLM.from_pretrained(str(models[kind]), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
        assert torch.equal(logits, ref(input_ids=ids).logits)
        assert not torch.equal(logits, start(input_ids=ids).logits)
