"""Pruning a model whose weights accelerate offloads: ``from_pretrained(device_map=...)`` with disk-offloaded modules,
``accelerate.disk_offload``, ``accelerate.cpu_offload`` and the weights map ``dispatch_model`` gives a device map's
CPU-offloaded modules, on a tiny random llama."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload, disk_offload
from accelerate.hooks import attach_align_device_hook
from accelerate.utils import OffloadedWeightsLoader
from accelerate.utils.modeling import get_state_dict_offloaded_model
from transformers import AutoModelForCausalLM

from sparseswaps_prune.core.spec import build_spec
from sparseswaps_prune.llm.models import tiny_model
from sparseswaps_prune.llm.offload import is_offloaded, onloaded
from sparseswaps_prune.llm.pipeline import PruneOptions, PruneResult, finalize, prune_model
from sparseswaps_prune.modules import PrunableLayer
from sparseswaps_prune.recipes import RECIPES

pytestmark = pytest.mark.filterwarnings("ignore:Attempting to save a model with offloaded modules:UserWarning")

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit
OPTIONS = PruneOptions(spec=build_spec(REFIT, max_iters=5))
CALIB = torch.randint(3, 3000, (4, 32), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(3, 3000, (2, 16), generator=torch.Generator().manual_seed(1))
# Embeddings, block 0 and the LM head on disk, block 1 in memory: the capture runs the offloaded embeddings and block 0,
# and the in-memory block gets the outputs of a pruned offloaded one.
DEVICE_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The tiny random llama (2 blocks) saved with ``save_pretrained``."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(saved) -> tuple[dict[str, torch.Tensor], PruneResult, torch.Tensor]:
    """The same model loaded in memory, pruned with the same options and finalized: its state dict, result and
    logits on ``PROBE``."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    result = prune_model(model, CALIB, OPTIONS, progress=False)
    finalize(model)
    with torch.no_grad():
        logits = model(PROBE).logits
    return model.state_dict(), result, logits


def load_offloaded(kind: str, saved: Path, folder: Path) -> torch.nn.Module:
    """The saved model offloaded as ``kind`` says (offload files in ``folder``)."""
    if kind == "device_map":
        return AutoModelForCausalLM.from_pretrained(saved, device_map=DEVICE_MAP, offload_folder=folder)
    model = AutoModelForCausalLM.from_pretrained(saved)
    if kind == "disk_offload":
        return disk_offload(model, folder, execution_device="cpu")
    if kind == "cpu_offload":
        return cpu_offload(model, execution_device="cpu")
    # What dispatch_model gives the "cpu" entries of a device map whose main device is a GPU: a loader's state_dict.
    weights = OffloadedWeightsLoader(state_dict=model.state_dict())
    attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=weights)
    return model


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["device_map", "disk_offload", "cpu_offload", "loader_state_dict"])
def test_offloaded_model_prunes_like_the_in_memory_one(kind, saved, reference, tmp_path):
    ref_state, ref_result, ref_logits = reference
    checkpoint = digest(saved / "model.safetensors")
    model = load_offloaded(kind, saved, tmp_path / "offload")
    assert is_offloaded(model.model.layers[0]) and model.model.layers[0].self_attn.q_proj.weight.is_meta

    result = prune_model(model, CALIB, OPTIONS, progress=False)
    timeless = lambda r: {k: v for k, v in asdict(r).items() if not k.startswith("seconds")}  # noqa: E731
    assert list(map(timeless, result.layers)) == list(map(timeless, ref_result.layers))
    assert result.masks.keys() == ref_result.masks.keys()
    assert all(torch.equal(result.masks[n], m) for n, m in ref_result.masks.items())
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta  # written back, not kept in memory
    for block in model.model.layers:  # pruned permanently, offloaded or not
        assert not any(hasattr(module, "weight_orig") for module in block.modules())
    if kind == "device_map":  # the block in memory stays where the device map put it
        assert all(p.device.type == "cpu" for p in model.model.layers[1].parameters())

    with torch.no_grad():  # the hooks load the pruned weights from the offload storage
        assert torch.equal(model(PROBE).logits, ref_logits)
    state = get_state_dict_offloaded_model(model)
    assert state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(state[name], tensor), name
    assert digest(saved / "model.safetensors") == checkpoint  # the checkpoint itself is never written

    if kind == "device_map":  # transformers saves offloaded models from their hooks' weights maps
        model.save_pretrained(tmp_path / "pruned")
    else:
        model.save_pretrained(tmp_path / "pruned", state_dict=state)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    modules = dict(reloaded.named_modules())
    for name, mask in ref_result.masks.items():
        weight = PrunableLayer(name, modules[name]).weight_2d()
        assert not weight[~mask].any() and weight[mask].count_nonzero() == mask.sum(), name
    assert all(torch.equal(reloaded.state_dict()[n], t) for n, t in ref_state.items())


def test_disk_offload_rewrites_the_offload_folder(saved, reference, tmp_path):
    ref_state, _, _ = reference
    model = load_offloaded("disk_offload", saved, tmp_path)
    prune_model(model, CALIB, OPTIONS, progress=False)
    stored = OffloadedWeightsLoader(save_folder=tmp_path)  # a new reader: the .dat files and index.json
    assert json.loads((tmp_path / "index.json").read_text()).keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(stored[name], tensor), name


def test_refused_options_leave_the_model_untouched(saved, tmp_path):
    model = load_offloaded("cpu_offload", saved, tmp_path)
    storage = model.model.layers[0].self_attn.q_proj._hf_hook.weights_map
    dense = storage["weight"].clone()
    with pytest.raises(ValueError, match=r"checkpoint_dir does not work .* offloads"):
        prune_model(model, CALIB, OPTIONS, progress=False, checkpoint_dir=tmp_path / "state")
    with pytest.raises(ValueError, match=r"distributed=True does not work .* offloads"):
        prune_model(model, CALIB, OPTIONS, progress=False, distributed=True)
    assert torch.equal(storage["weight"], dense) and not (tmp_path / "state").exists()

    # transformers reads disk-offloaded weights from the checkpoint itself when there is no offload folder
    model = AutoModelForCausalLM.from_pretrained(saved, device_map=DEVICE_MAP)
    with pytest.raises(ValueError, match=r"no folder to write the pruned tensor to.*offload_folder="):
        prune_model(model, CALIB, OPTIONS, progress=False)


def test_onloaded_writes_nothing_back_when_the_body_raises(saved, tmp_path):
    model = load_offloaded("device_map", saved, tmp_path)
    block = model.model.layers[0]
    proj = block.self_attn.q_proj
    dense = proj._hf_hook.weights_map["weight"].clone()
    with torch.no_grad():
        logits = model(PROBE).logits
    with pytest.raises(RuntimeError, match="stop"), onloaded(block, "cpu"):
        assert torch.equal(proj.weight, dense) and proj.weight.device.type == "cpu"
        with torch.no_grad():
            proj.weight.zero_()
        raise RuntimeError("stop")
    assert proj.weight.is_meta and torch.equal(proj._hf_hook.weights_map["weight"], dense)
    with torch.no_grad():
        assert torch.equal(model(PROBE).logits, logits)
