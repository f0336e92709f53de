"""What torch and safetensors do, which the package's behaviour and documentation rely on.

These test no code of the package: a failure here means an upstream change that the package
must answer, not a bug in it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor.parallel import parallelize_module

from tests.nn.distributed.tiny_lm import TinyLM
from tests.nn.models import TiedLM
from toolkit.nn import ModuleDefaultDict, TiedLinearParallel


def test_f_linear_takes_a_1d_weight_and_drops_the_output_feature_axis() -> None:
    """Why TiedLinear checks that the weight is 2-D on every call."""
    assert F.linear(torch.randn(2, 3), torch.randn(3)).shape == (2,)


def test_safetensors_refuses_a_state_dict_whose_tensors_share_memory(tmp_path: Path) -> None:
    """Why a tie through a shared Parameter cannot be saved where TiedLinear's can."""
    shared = nn.Module()
    shared.emb = nn.Embedding(7, 3)
    shared.head = nn.Linear(3, 7, bias=False)
    shared.head.weight = shared.emb.weight
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(shared.state_dict(), tmp_path / "shared.safetensors")


def test_module_dict_refuses_a_value_that_is_not_a_module() -> None:
    """The error ModuleDefaultDict's initial values and entries give too."""
    with pytest.raises(TypeError, match="int is not a Module subclass"):
        nn.ModuleDict({"a": 3})  # type: ignore[dict-item]


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is set
def test_a_dcp_load_fills_only_the_keys_it_is_given(tmp_path: Path) -> None:
    """Why create_entries exists: the plain DCP recipe resumes a fresh model with no entries."""
    trained = nn.Module()
    trained.heads = ModuleDefaultDict(lambda: nn.Linear(2, 2))
    trained.heads["a"]
    dcp.save({"model": trained.state_dict()}, checkpoint_id=tmp_path)
    fresh = nn.Module()
    fresh.heads = ModuleDefaultDict(lambda: nn.Linear(2, 2))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    fresh.load_state_dict(state["model"], strict=True)
    assert list(fresh.heads) == []


def test_fsdp1_on_a_cpu_only_machine_needs_the_device_named(one_rank: DeviceMesh) -> None:
    """Why the FSDP1 setups and docs/sharded-training.md pass ``device_id=torch.device("cpu")``."""
    if torch.cuda.is_available():
        pytest.skip("FSDP1 finds the accelerator")
    with pytest.raises(RuntimeError, match="FSDP needs a non-CPU accelerator device"):
        FullyShardedDataParallel(TinyLM())


def test_parallelize_module_skips_a_plan_key_that_names_no_submodule(one_rank: DeviceMesh) -> None:
    """Why the tensor-parallel guide applies TiedLinearParallel to the head in its own call:
    TiedLinear is no Module, so a plan on the whole model cannot reach ``head.linear``."""
    model = TiedLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(model, one_rank, {"head.linear": TiedLinearParallel()})
    assert [str(w.message).split(":")[0] for w in caught] == [
        "Parallelize plan key 'head.linear' could not be resolved"
    ]
    assert not model.head.linear._forward_pre_hooks
