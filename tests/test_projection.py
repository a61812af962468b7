"""Projected caches (the fold) against independent computations: the stored values against the
basis applied to the model's own output_hidden_states; the exported drafter on the full tapped
layers against the training forward on the stored values, for both families; one basis whatever
the number of processes; a damaged or different basis refused."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import CHAT, ROOT, TINY_TARGET, assert_same_cache, extract_config, jsonl_head, read_cache
from transformers import AutoModelForCausalLM

from dflash_cache import drafters
from dflash_cache.cache.audit import info, verify
from dflash_cache.cache.projection import PROJECTION, Basis
from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.cache.unit.codec import decode_hidden
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.extract.stage import ExtractError, prepare, run
from dflash_cache.train.fold import folded, save_export

ROWS = 120
JOINT = {"project": "auto", "storage": "bf16"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text(jsonl_head(CHAT, ROWS))
    return path


@pytest.fixture(scope="module")
def joint(tmp_path_factory, data):
    """A projected cache of the default rank (a joint basis of H values a token) in bf16, whose
    stored values compare with the model's own at bf16's precision."""
    out = tmp_path_factory.mktemp("joint") / "cache"
    run(extract_config(out, data=str(data), unit_mb=1, **JOINT))
    return out


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("per_layer") / "cache"
    run(extract_config(out, data=str(data), project=40, project_basis="per-layer", unit_mb=1))
    return out


def _reference_taps(spec, ids: np.ndarray) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
    return [states[lid + 1][0] for lid in spec.layers.ids]


def test_the_default_cache_is_h_values_a_token_in_fp8(data, tmp_path):
    """`dflash extract` with no --project or --storage plans H projected values a token in fp8
    (the smallest setting that kept tau on the real SmolLM2); --project none keeps bf16."""
    from dflash_cache.extract.config import ExtractConfig

    defaults = ExtractConfig(target=str(TINY_TARGET), data=str(data), out=tmp_path / "c")
    assert (defaults.project, defaults.storage) == ("auto", "auto")
    spec = prepare(extract_config(tmp_path / "c", data=str(data), project="auto", storage="auto"), write=False).spec
    assert spec.projection.rank == spec.target.hidden_size and spec.storage.dtype == "fp8"
    spec = prepare(extract_config(tmp_path / "c", data=str(data), project="none", storage="auto"), write=False).spec
    assert spec.projection is None and spec.storage.dtype == "bf16"
    spec = prepare(extract_config(tmp_path / "c", data=str(data), project=24, storage="bf16"), write=False).spec
    assert spec.projection.rank == 24 and spec.storage.dtype == "bf16"


def test_stored_values_are_the_basis_applied_to_the_models_hidden_states(joint):
    spec = read_spec(joint)
    H, K = spec.target.hidden_size, len(spec.layers.ids)
    assert spec.projection.basis == "joint" and spec.projection.rank == H and spec.format_version == 2
    assert spec.projection.fitted_tokens == spec.plan.num_tokens  # fewer tokens than --project-fit-tokens: all
    basis = Basis.load(joint, spec)
    assert basis.rank == H and basis.weights[0].shape == (H, K * H)
    cached = read_cache(joint)
    for s in sorted(cached)[:: len(cached) // 6]:
        bits, ids, _, _ = cached[s]
        got = decode_hidden(torch.from_numpy(bits), None, 1).float()
        x = torch.cat(_reference_taps(spec, ids), dim=1)
        want = x @ basis.weights[0].T
        # bf16 storage: 2^-8 of each value, and the float32 noise of a padded batch against one sample
        scale = want.abs().amax(dim=1, keepdim=True)
        assert ((got - want).abs() <= scale * 2**-7 + 1e-4).all()
    facts = info(joint)
    assert facts["fraction_of_raw_bf16"] < 0.25  # H of K*H values (0.2), the ids and mask beside them
    assert len(facts["retained_energy"]) == K and all(0.5 < e <= 1 for e in facts["retained_energy"])
    # the basis keeps most of each layer's energy: what W drops is measured on the fit sample itself
    assert verify(joint) == {}


@pytest.mark.parametrize("family_name", ["dflash", "dspark"])
def test_the_exported_drafter_on_the_full_layers_is_the_training_forward_on_the_stored_values(
        joint, per_layer, family_name, tmp_path):  # fmt: skip
    """fc' trained on z = W x and fc = fc' W exported: on the target's full tapped layers the
    export computes, in float32, what training computed on z, for a joint basis and for a
    per-layer one read by a subset of the layers; every other weight is exported as it is."""
    family = drafters.family(family_name)
    for cache, layers in ((joint, None), (per_layer, [1, 5])):
        spec = read_spec(cache)
        settings = family.settings(draft_layers=1, layers=layers, block_size=4)
        dcfg = family.config(settings, spec)
        torch.manual_seed(0)
        model = family.model(dcfg).eval()
        basis = Basis.load(cache, spec)
        positions = spec.group_positions(dcfg.target_layer_ids)
        assert model.fc.in_features == dcfg.context_width == sum(basis.weights[g].shape[0] for g in positions)

        ids = np.asarray(read_cache(cache)[3][1])
        taps = _reference_taps(spec, ids)
        x = torch.cat([taps[spec.layers.ids.index(i)] for i in dcfg.target_layer_ids], dim=1)
        z = torch.cat([basis.project(taps)[g] for g in positions], dim=1)
        n = x.shape[0]
        anchors = torch.tensor([2, n // 2, n - 5])
        layout = BlockLayout.build(torch.tensor([0, n]), torch.zeros(3, dtype=torch.long), anchors, 4)
        embeds = torch.randn(3 * 4, dcfg.hidden_size)
        served, served_cfg = folded(model, dcfg, cache)
        assert served.fc.in_features == len(dcfg.target_layer_ids) * dcfg.hidden_size
        with torch.no_grad():
            trained_out = model(embeds, z, layout)
            served_out = served(embeds, x, layout)
        torch.testing.assert_close(served_out, trained_out, rtol=1e-5, atol=1e-5)
        assert (trained_out - served(embeds, torch.randn_like(x), layout)).abs().max() > 1e-2  # x matters

        save_export(family, model, dcfg, tmp_path / "export", cache_dir=cache)
        loaded, loaded_cfg, _ = drafters.load_serving(tmp_path / "export", dtype=torch.float32)
        assert loaded_cfg.context_width is None
        mine = {k: v for k, v in served.state_dict().items()}
        for key, value in loaded.state_dict().items():
            if key in mine:
                torch.testing.assert_close(value, mine[key].to(torch.bfloat16).float(), rtol=0, atol=0)
        assert json.loads((tmp_path / "export" / "config.json").read_text()).get("context_width") is None


def test_layer_subsets_need_a_per_layer_basis(joint, per_layer):
    with pytest.raises(SpecError, match="per-layer"):
        drafters.family("dflash").config(drafters.family("dflash").settings(layers=[1, 5]), read_spec(joint))
    spec = read_spec(per_layer)
    assert spec.context_width([1, 5]) == 2 * 40 // len(spec.layers.ids)


def test_a_rerun_with_another_basis_is_refused(joint, data):
    spec = read_spec(joint)
    for change, field in (({"project": 16}, "projection.rank"), ({"project_basis": "per-layer"}, "projection.basis"),
                          ({"project": "none"}, "projection")):  # fmt: skip
        with pytest.raises(ExtractError, match=field.replace(".", r"\.")):
            prepare(extract_config(joint, data=str(data), unit_mb=1, **{**JOINT, **change}))
    prepare(extract_config(joint, data=str(data), unit_mb=1, **JOINT))  # the same settings resume
    assert read_spec(joint) == spec


def test_a_damaged_basis_is_found_and_refused(joint, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(joint, cache)
    path = cache / PROJECTION
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x40
    path.write_bytes(raw)
    assert list(verify(cache)) == [PROJECTION]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", "--cache", str(cache), "--out",
                           str(tmp_path / "run"), "--draft-layers", "1"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error:") and PROJECTION in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "checkpoints").exists()
    path.unlink()
    done = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(cache)], capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert done.returncode == 1 and "missing" in done.stdout + done.stderr


@pytest.mark.slow  # two extract processes
def test_two_processes_fit_one_basis_and_write_the_same_cache(joint, data, tmp_path):
    out = tmp_path / "cache"
    run(extract_config(out, data=str(data), unit_mb=1, procs=2, **JOINT))
    assert read_spec(out).projection == read_spec(joint).projection  # the same digest: one basis, fitted once
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(["frozen.safetensors", PROJECTION])
    assert_same_cache(out, joint)


def test_fp8_storage_of_projected_values(joint, data, tmp_path):
    """fp8 keeps every stored token's relative error under 7%, as for the layers themselves."""
    out = tmp_path / "cache"
    run(extract_config(out, data=str(data), project="auto", unit_mb=1, storage="fp8"))
    assert read_spec(out).projection.digest == read_spec(joint).projection.digest
    a, b = read_cache(out), read_cache(joint)
    for s in list(a)[:40]:
        got = decode_hidden(torch.from_numpy(a[s][0]), torch.from_numpy(a[s][3]), 1)
        ref = decode_hidden(torch.from_numpy(b[s][0]), None, 1).float()
        assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.07


@pytest.mark.slow  # a CLI train and export
def test_a_drafter_trains_on_a_projected_cache_and_dflash_export_folds_it(joint, tmp_path):
    """The CLI's train and export on a projected cache: the export is the serving format, whose fc
    reads the full tapped layers, and `dflash export` of the same run writes the same weights."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", "--cache", str(joint), "--out", str(run_dir),
                           "--draft-layers", "1", "--epochs", "1", "--max-steps", "3", "--json"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    spec = read_spec(joint)
    _, cfg, _ = drafters.load_serving(run_dir / "export")
    assert cfg.context_width is None
    from safetensors.torch import load_file

    fc = load_file(str(run_dir / "export" / "model.safetensors"))["fc.weight"]
    assert fc.shape == (spec.target.hidden_size, len(spec.layers.ids) * spec.target.hidden_size)
    done = subprocess.run([sys.executable, "-m", "cli.main", "export", str(run_dir), str(tmp_path / "again")],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert torch.equal(again["fc.weight"], fc)


@pytest.mark.slow  # two CLI dry runs
def test_the_dry_run_estimates_the_projected_size(data, tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    sizes = {}
    for project in ("auto", "none"):
        done = subprocess.run([sys.executable, "-m", "cli.main", "extract", "--target", str(TINY_TARGET), "--data",
                               str(data), "--out", str(tmp_path / project), "--dry-run", "--project", project],
                              capture_output=True, text=True, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        sizes[project] = json.loads(done.stdout)
    assert sizes["auto"]["stored_values_per_token"] * 5 == sizes["none"]["stored_values_per_token"]  # H of 5 H
    assert (sizes["auto"]["storage"], sizes["none"]["storage"]) == ("fp8", "bf16")
    assert sizes["auto"]["estimated_bytes_max"] < sizes["none"]["estimated_bytes_max"] / 5
    assert not (tmp_path / "auto").exists()


def test_bad_projection_settings_are_refused(tmp_path, data):
    with pytest.raises(ExtractError, match="--project: rank 999"):
        prepare(extract_config(tmp_path / "c", data=str(data), project=999), write=False)
    with pytest.raises(ExtractError, match="multiple"):
        prepare(extract_config(tmp_path / "c", data=str(data), project=33, project_basis="per-layer"), write=False)
    assert not (tmp_path / "c").exists()


def test_a_validation_cache_needs_the_training_caches_basis(joint, per_layer, tiny_cache):
    from dflash_cache.train.validate import check_val_cache

    layers = read_spec(joint).layers.ids
    for other in (per_layer, tiny_cache):  # another basis; the layers as they are
        with pytest.raises(SpecError, match="projection"):
            check_val_cache(joint, other, layers)


@pytest.mark.slow  # two sharded processes
def test_a_sharded_copy_fits_one_basis_with_its_ranks(joint, data, tmp_path):
    """--procs 2 --tp 2: the copy's two ranks run the fit's forwards together and its lead writes
    the basis; the basis keeps what the one-process fit keeps (the sharded sums round otherwise)."""
    out = tmp_path / "cache"
    run(extract_config(out, data=str(data), unit_mb=1, procs=2, tp=2, **JOINT))
    sharded, single = read_spec(out).projection, read_spec(joint).projection
    assert (sharded.basis, sharded.rank, sharded.fitted_tokens) == (single.basis, single.rank, single.fitted_tokens)
    np.testing.assert_allclose(sharded.retained_energy, single.retained_energy, atol=1e-3)
    assert verify(out) == {}
    assert sorted(read_cache(out)) == sorted(read_cache(joint))


def test_extract_says_what_the_basis_keeps_and_names_the_layers_it_neglects(data, tmp_path):
    """`dflash extract`, in the form a user runs it, prints each tapped layer's energy kept as soon
    as the basis is fitted, and names the layers under LOW_ENERGY with a larger --project to try.
    The tiny target's random features are nearly isotropic, so 32 of its 320 values keep about 80%
    of each layer; 300 keep nearly all."""
    from dflash_cache.extract.basis import LOW_ENERGY

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "400"}
    for project in ("32", "300"):
        out = tmp_path / project
        done = subprocess.run([sys.executable, "-m", "cli.main", "extract", "--target", str(TINY_TARGET), "--data",
                               str(data), "--out", str(out), "--project", project, "--unit-mb", "1",
                               "--tokenize-procs", "1"], capture_output=True, text=True, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        spec = read_spec(out)
        kept = spec.projection.retained_energy
        line = next(ln for ln in (done.stdout + done.stderr).splitlines() if "energy kept per tapped layer" in ln)
        assert "energy kept per tapped layer: " + ", ".join(f"{100 * e:.1f}%" for e in kept) in line
        low = [str(layer) for layer, e in zip(spec.layers.ids, kept, strict=True) if e < LOW_ENERGY]
        if project == "32":
            assert low == [str(layer) for layer in spec.layers.ids], kept
            assert f"layers {', '.join(low)} keep under 97%" in line and "--project 64 keeps more" in line
        else:
            assert low == [] and "under" not in line and "--project" not in line, line


def test_the_larger_rank_the_energy_note_suggests_is_one_extract_takes(per_layer):
    """Twice the rank, within what extract accepts for the basis (under K x H, a multiple of K for
    a per-layer basis); none but `--project none` where no larger rank exists."""
    import dataclasses

    from dflash_cache.cache.projection import check_projection
    from dflash_cache.extract.basis import energy_note

    spec = read_spec(per_layer)
    k, h = len(spec.layers.ids), spec.target.hidden_size
    for basis, rank, suggested in (("per-layer", 40, 80), ("per-layer", 300, 315), ("joint", 200, 319),
                                   ("joint", 319, None)):  # fmt: skip
        proj = dataclasses.replace(spec.projection, basis=basis, rank=rank, retained_energy=[0.9] * k)
        note = energy_note(dataclasses.replace(spec, projection=proj))
        assert note.endswith("--project none everything"), note
        if suggested is None:
            assert "keeps more" not in note, note
        else:
            assert f"--project {suggested} keeps more" in note, note
            assert check_projection(basis, suggested, "layer-rms", k, h) is None
    # a layer is judged as its percentage is shown: 96.996% shows as 97.0% and is not called under 97%
    for kept, under in ((0.96996, False), (0.9694, True)):
        proj = dataclasses.replace(spec.projection, retained_energy=[kept] * k)
        assert ("under 97%" in energy_note(dataclasses.replace(spec, projection=proj))) is under
