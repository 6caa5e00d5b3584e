"""Hugging Face files for a prepared directory: a SentencePiece model converted to the
``tokenizers`` format (``tokenizer.json``, ``tokenizer_config.json``), and a user's
``--tokenizer`` installed (a SentencePiece model, or a Hugging Face tokenizer directory).

Every prepared directory gets these files beside ``tokenizer.model`` so that
``transformers.AutoTokenizer.from_pretrained(DIR)`` encodes the same ids (``add_special_tokens=
False``). Only ``tokenizers`` is needed to write them; transformers only to install a Hugging
Face tokenizer. Loading and encoding live in :mod:`anneal.data.tokenizer`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from anneal.data.tokenizer import (
    PIECE_BYTE,
    PIECE_CONTROL,
    PIECE_NORMAL,
    PIECE_UNKNOWN,
    PIECE_USER_DEFINED,
    read_proto,
    tokenizer_sha256,
)
from anneal.errors import UserError


def spm_to_hf(proto):
    """A ``tokenizers.Tokenizer`` that encodes like SentencePiece ``proto`` (BPE or unigram).

    Follows transformers' ``SpmConverter.build_tokenizer_from_spm_proto`` (normaliser spec,
    BPE merges ranked by piece score, user-defined pieces isolated, byte fallback), needing only
    the ``tokenizers`` library, with changes that make the ids equal where SentencePiece never
    matches a piece in text: control, unknown and byte pieces (``</s>``, ``<0x41>``)."""
    from tokenizers import Tokenizer, pre_tokenizers

    spec, norm = proto.trainer_spec, proto.normalizer_spec
    user_defined = [p.piece for p in proto.pieces if p.type == PIECE_USER_DEFINED]
    tk = Tokenizer(_spm_model(proto, user_defined))
    tk.normalizer = _spm_normalizer(norm)
    pre = _spm_pre_tokenizers(norm, user_defined)
    if pre:
        tk.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tk.decoder = _spm_decoder(spec, norm)
    return tk


def _spm_model(proto, user_defined: list[str]):
    """The unigram or BPE model of ``proto``, its unmatchable pieces out of reach."""
    from tokenizers.models import BPE, Unigram

    spec = proto.trainer_spec
    if spec.model_type == 1:  # UNIGRAM: unmatchable pieces score out of Viterbi's reach
        unmatchable = (PIECE_UNKNOWN, PIECE_CONTROL, PIECE_BYTE)
        vocab = [(p.piece, -1e9 if p.type in unmatchable else p.score) for p in proto.pieces]
        return Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    if spec.model_type == 2:  # BPE: merges only between ordinary pieces, best score first
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        normal = {
            p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == PIECE_NORMAL
        }
        ranked = []
        for piece, (score, i) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, i, left, right))
        merges = [(left, right) for _, _, left, right in sorted(ranked)]
        return BPE(
            vocab=vocab,
            merges=merges,
            unk_token=spec.unk_piece,
            fuse_unk=True,
            byte_fallback=spec.byte_fallback,
            # whole pre-tokens are looked up only if a user-defined piece needs it
            ignore_merges=any(len(p) > 1 for p in user_defined),
        )
    raise UserError(
        f"--tokenizer: this SentencePiece model's type ({spec.model_type}) cannot be "
        f"converted for Hugging Face; only BPE and unigram models can. Reuse a BPE or "
        f"unigram model, or let prepare train one."
    )


def _spm_normalizer(norm):
    """SentencePiece's normaliser spec as a ``tokenizers`` normaliser."""
    from tokenizers import Regex, normalizers

    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    return normalizers.Sequence(steps)


def _spm_pre_tokenizers(norm, user_defined: list[str]) -> list:
    """The dummy prefix, and user-defined pieces cut out whole (empty: no pre-tokenizer)."""
    from tokenizers import Regex, pre_tokenizers

    pre = []
    if norm.add_dummy_prefix:  # SentencePiece prefixes the text once, not each piece of it
        pre.append(
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        )
    if user_defined:
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        pre.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    return pre


def _spm_decoder(spec, norm):
    """Pieces back to text: '▁' read as a space, byte pieces as bytes, the prefix dropped."""
    from tokenizers import decoders

    dec = [decoders.Replace("\u2581", " ")]
    if spec.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    return decoders.Sequence(dec)


def save_hf_files(model_path: Path, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` beside ``tokenizer.model`` so that
    ``AutoTokenizer.from_pretrained(out_dir)`` encodes the same ids as SentencePiece (with
    ``add_special_tokens=False``; text that spells ``</s>`` stays text, as in SentencePiece:
    ``split_special_tokens``). Needs only ``tokenizers``, not transformers."""
    from tokenizers import AddedToken

    proto = read_proto(model_path)
    tk = spm_to_hf(proto)
    spec = proto.trainer_spec
    special = {"unk_token": proto.pieces[spec.unk_id].piece}
    if spec.eos_id >= 0:
        special["eos_token"] = proto.pieces[spec.eos_id].piece
    if spec.bos_id >= 0:
        special["bos_token"] = proto.pieces[spec.bos_id].piece
    if spec.pad_id >= 0:
        special["pad_token"] = proto.pieces[spec.pad_id].piece
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    tk.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "pad_token": None,
        **special,
        "split_special_tokens": True,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,  # transformers' "none"
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def install(source: Path | None, out_dir: Path) -> dict:
    """Copy a user's tokenizer into ``out_dir`` (a SentencePiece ``.model`` file, a directory
    holding one, or a Hugging Face tokenizer directory with ``tokenizer.json``) and write the
    Hugging Face files. Returns its description for meta.json."""
    source = Path(source)
    if source.is_dir() and (source / "tokenizer.json").is_file():
        return _install_hf(source, out_dir)
    model = source / "tokenizer.model" if source.is_dir() else source
    if not model.is_file():
        raise UserError(
            f"--tokenizer {source}: not a SentencePiece model file, nor a directory with "
            f"tokenizer.model or tokenizer.json. Pass the .model file or the directory that "
            f"AutoTokenizer.from_pretrained loads."
        )
    try:
        read_proto(model)
    except Exception:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"--tokenizer {model}: not a SentencePiece model (cannot parse).") from None
    shutil.copyfile(model, out_dir / "tokenizer.model")
    save_hf_files(out_dir / "tokenizer.model", out_dir)
    return {"kind": "sentencepiece", "trained": False, "from": str(source)}


def _install_hf(source: Path, out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        tok = AutoTokenizer.from_pretrained(str(source), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise remote_code_refused(f"--tokenizer {source}", e) or UserError(
            f"--tokenizer {source}: AutoTokenizer cannot load it ({first_line(e)})."
        ) from None
    if tok.eos_token_id is None:
        raise UserError(
            f"--tokenizer {source}: the tokenizer has no eos_token; Anneal separates documents "
            f"with EOS. Set eos_token in its tokenizer_config.json."
        )
    tok.split_special_tokens = True
    tok.save_pretrained(str(out_dir))
    # The prepared directory's ids are tokenizer.json's; a SentencePiece file saved beside it
    # would make it look like a SentencePiece directory.
    (out_dir / "tokenizer.model").unlink(missing_ok=True)
    return {"kind": "huggingface", "trained": False, "from": str(source)}


def first_line(e: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none), for a paragraph."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def remote_code_refused(where: str, e: BaseException) -> UserError | None:
    """The paragraph for transformers' refusal to run a directory's own Python code (a class
    named only in its ``auto_map``): Anneal passes ``trust_remote_code=False`` wherever it
    loads a Hugging Face class, config or tokenizer, so transformers neither asks at a
    terminal nor runs it. None for any other error."""
    if "trust_remote_code" not in str(e):
        return None
    return UserError(
        f"{where}: its tokenizer or model is a class that exists only as Python code in the "
        f"directory (auto_map in tokenizer_config.json or config.json), which transformers "
        f"would have to run to load it. Anneal never runs code from a model or tokenizer "
        f"directory (trust_remote_code=False). Give a tokenizer.json with a class "
        f"transformers ships (tokenizer_class PreTrainedTokenizerFast) and a model of an "
        f"architecture it ships."
    )


def installed_sha256(source: Path) -> str:
    """The ``tokenizer_sha256`` a directory prepared with ``--tokenizer source`` gets: that of
    the files ``install`` writes from ``source`` (written to a temporary directory, hashed,
    removed). How a model directory's tokenizer is matched with prepared data (``--init-from``).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="anneal-tokenizer-") as tmp:
        install(Path(source), Path(tmp))
        return tokenizer_sha256(Path(tmp))
