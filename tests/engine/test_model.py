"""Model plumbing (guardrails.engine.model) on real wrappers: DDP over a one-rank gloo group,
torch.compile, FSDP2 on a one-rank CPU mesh; every one unwraps to the bare module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import Regressor
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from guardrails.engine import model as _model


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: How to wrap a model, and how many modules the chain then holds (the bare one included).
#: HF accelerate's prepare() builds these same two wrappers (DDP, torch.compile).
WRAPS = {
    "bare": (lambda m: m, 1),
    "compile": (torch.compile, 2),
    "ddp": (DDP, 2),
    "ddp(compile)": (lambda m: DDP(torch.compile(m)), 3),
    "compile(ddp)": (lambda m: torch.compile(DDP(m)), 3),
}


@pytest.mark.parametrize("kind", sorted(WRAPS))
def test_every_wrapper_kind_unwraps_to_the_bare_module(one_rank, kind):
    bare = Regressor()
    wrap, depth = WRAPS[kind]
    wrapped = wrap(bare)
    assert _model.unwrap(wrapped) is bare
    chain = _model.wrappers(wrapped)
    assert chain[0] is wrapped and chain[-1] is bare and len(chain) == depth
    # Its state_dict keys are the model's own: no module. / _orig_mod. prefix.
    assert list(_model.unwrap(wrapped).state_dict()) == list(bare.state_dict())
    ddp = "ddp" in kind
    assert _model.grads_agree(wrapped) is ddp
    assert not _model.is_sharded(wrapped) and not _model.holds_shards(wrapped)


def test_a_falsy_module_is_still_unwrapped():
    # nn.Sequential has __len__: an empty one is falsy, and must not end the walk.
    bare = nn.Sequential()
    assert not bare
    assert _model.unwrap(torch.compile(bare)) is bare


def test_fsdp2_is_sharded_and_its_grads_agree(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Regressor()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert _model.unwrap(model) is model  # fully_shard wraps nothing
    assert _model.is_sharded(model) and _model.holds_shards(model)
    assert _model.grads_agree(model)


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_fsdp1_holds_shards_but_is_not_unwrapped(one_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(Regressor(), device_id=torch.device("cpu"))
    # The module inside holds flat shards, not the model's parameters: not unwrapped.
    assert _model.unwrap(model) is model
    # Its weights differ per rank (preflight compares none), but they are local tensors:
    # no global norm, no DTensor checkpoint path, and the ranks' gradients differ.
    assert _model.holds_shards(model) and not _model.is_sharded(model)
    assert not _model.grads_agree(model)


def test_find_loss_in_every_output_shape():
    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    logits = x * 3
    assert _model.find_loss(loss) is loss
    assert _model.find_loss((logits, loss)) is loss
    assert _model.find_loss([logits, loss]) is loss
    assert _model.find_loss({"logits": logits, "loss": loss}) is loss
    assert _model.find_loss(SimpleNamespace(loss=loss, logits=logits)) is loss
    # Not a loss: no graph, not a scalar, not floating point, or not where it is looked for.
    assert _model.find_loss(loss.detach()) is None
    assert _model.find_loss(logits) is None
    assert _model.find_loss(torch.tensor(3)) is None
    assert _model.find_loss({"out": loss}) is None
    assert _model.find_loss((logits,) * 4 + (loss,)) is None
    assert _model.find_loss(None) is None


def test_named_arguments_bind_through_wrappers():
    bare = Regressor()
    x, y = torch.zeros(2, 4), torch.zeros(2)
    assert _model.named_arguments(torch.compile(bare), (x,), {"y": y}) == {"x": x, "y": y}
    # A signature that cannot bind them: positional names.
    assert _model.named_arguments(bare, (x, y, x), {}) == {"arg0": x, "arg1": y, "arg2": x}


def test_to_device_keeps_the_batch_structure():
    t = torch.zeros(2)
    out = _model.to_device({"a": (t, [t]), "b": 3}, torch.device("cpu"))
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert out["b"] == 3 and torch.equal(out["a"][0], t)
