"""The census: healthy training loops of the kinds people run, each under
``guardrails.guard(...)`` with every default, must end with no warning at all (none in
``events.jsonl``, none logged on stderr, no Python warning from guardrails). A guard
that warns on a healthy run gets turned off.

Each loop is written as its users write it (their epoch loop from ``g.epoch``, their
scheduler, EMA and generators passed to the guard as the docs ask) and runs long enough
for every detector to be armed (:data:`STEPS`). ``pytest -m census`` runs this tier.

What each detector needs before it can fire, with the defaults:

* params not in the optimizer: at the start; params without grad, stale gradients:
  steps 1-2; no_loss: step 1.
* spike: 20 finite steps (judged every 10, NanGuard's ``check_every_n_steps``).
* divergence: 40 steps (2 x ``divergence_steps``), its full reference from 100.
* loss_not_decreasing: the first ``window_steps`` (100) steps.
* data_starvation: the window of steps 2-101.
* GC: a scheduled young collection every 100 steps, a full one every 1000.
* the efficiency advisor: after step 1; FLOPs at step 2; host syncs at steps 21-23.
* leak: a check every 100 steps; growth over 4 checks in a row starts a census (step
  500) that the next check confirms (step 600): :data:`STEPS`.
* straggler / slowdown / comms_bound: a window is judged only once 10 s of wall time
  have passed (Pace's ``compare_every_s``), and a finding must hold 2 windows (a
  slowdown is judged against the best of the windows before, the first one excluded):
  20-40 s of a loop's wall time, beyond this tier's budget, so these loops do not arm
  them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_port, read_events, spawn
from torch import nn
from torch.nn import functional as F

import guardrails

pytestmark = [
    pytest.mark.census,
    pytest.mark.slow(reason="600 guarded steps per loop, in a process of its own: ~3 CPU-s"),
]

#: Optimizer steps each loop trains: the leak check's confirmation comes at step 600
#: (checks every 100 steps, 4 rises in a row, then a census confirmed one check later),
#: the last detector a few hundred steps can arm.
STEPS = 600


class Census:
    """A loop's run_dir, and what it logged and warned while it ran."""

    def __init__(self, run_dir: Path, capfd: Any) -> None:
        self.run_dir, self._capfd = run_dir, capfd
        self._logged: list[str] = []
        self._warned: list[tuple[str, str]] = []

    def run(self, loop: Any) -> None:
        """``loop(run_dir)`` in a process of its own, forked from the suite's fork server:
        600 steps of every default leave the process's allocator and Python wrappers in
        a state the tests after it would inherit (test_memory's healthy loops, run after
        two census loops in one process, saw 5 new storage wrappers a step of the tensors
        their data list held: a false leak)."""
        out = self.run_dir.parent / "census.json"
        spawn(_silent_child, (loop.__name__, str(self.run_dir), str(out)), nprocs=1)
        found = json.loads(out.read_text())
        self._logged, self._warned = found["logged"], [tuple(w) for w in found["warned"]]

    def assert_silent(self) -> None:
        """The run trained its :data:`STEPS` steps (on every rank) with no warning
        event, no guardrails warning logged, no Python warning from guardrails."""
        events = read_events(self.run_dir)
        warned = [e for e in events if e["level"] != "info"]
        assert not warned, [(e["kind"], e["step"], e["message"]) for e in warned]
        assert not self._logged, self._logged
        mine = f"{os.sep}guardrails{os.sep}"
        py = [message for message, filename in self._warned if mine in filename]
        assert not py, py
        err = self._capfd.readouterr().err  # what reached stderr itself (a tqdm.write)
        assert "[rank " not in err and "guardrails" not in err, err
        ends = [e for e in events if e["kind"] == "end"]
        assert ends and {e["step"] for e in ends} == {STEPS}, ends


def _silent_child(rank: int, loop: str, run_dir: str, out: str) -> None:
    """One census loop, by name, with what guardrails logged at WARNING and every Python
    warning recorded to ``out`` (JSON) for the test to judge."""
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    logging.getLogger("guardrails").addHandler(Keep(logging.WARNING))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        globals()[loop](Path(run_dir))
    warned = [(str(w.message), w.filename) for w in caught]
    Path(out).write_text(json.dumps({"logged": logged, "warned": warned}))


@pytest.fixture
def census(tmp_path, capfd):
    return Census(tmp_path / "run", capfd)


# ------------------------------------------------------------------ 1. vision, BatchNorm


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _images(n: int, seed: int, classes: int = 4, side: int = 8) -> torch.utils.data.TensorDataset:
    """Noisy ``side`` x ``side`` images whose class is which quadrant is bright."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=gen)
    x = torch.randn(n, 3, side, side, generator=gen) * 0.5
    h = side // 2
    for c in range(classes):
        r, q = divmod(c, 2)
        x[y == c, :, h * r : h * r + h, h * q : h * q + h] += 1.0
    return torch.utils.data.TensorDataset(x, y)


def vision_bn_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(
        _images(320, seed=0), batch_size=16, shuffle=True, generator=gen, drop_last=True
    )
    n_epochs = STEPS // len(loader)
    model = SmallConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=n_epochs * len(loader))
    with guardrails.guard(model, opt, loader, scheduler=sched, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x, y in g:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()


def test_vision_with_batchnorm_sgd_momentum_cosine(census):
    census.run(vision_bn_loop)
    census.assert_silent()


# ------------------------------------------------ 2. an LM: warm-up, accumulation, clipping


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 32, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.ln(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))
        logits = self.lm_head(h)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    vocab, ctx, batch, accum, warmup = 16, 16, 8, 2, 60
    gen = torch.Generator().manual_seed(1)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        # Sequences counting up by a per-sequence stride, mod the vocabulary.
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        seq = (start + stride * torch.arange(ctx + 1)) % vocab
        return seq[:, :-1], seq[:, 1:]

    model = TinyGPT(vocab, ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / (STEPS - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    with guardrails.guard(
        model,
        opt,
        iter(get_batch, None),
        scheduler=sched,
        generators={"gen": gen},
        run_dir=run_dir,
    ) as g:
        batches = iter(g)
        for _step in range(g.step, STEPS):
            for _micro in range(accum):
                x, y = next(batches)
                _, loss = model(x, y)
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.slow(reason="1,200 micro-batches of a transformer")
def test_lm_with_warmup_accumulation_and_clipping(census):
    census.run(lm_loop)
    census.assert_silent()


# ------------------------------------------------------- 3. a frozen backbone's fine-tune


def frozen_backbone_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    backbone.requires_grad_(False)  # "pretrained": only the head trains
    head = nn.Linear(32, 3)
    model = nn.Sequential(backbone, head)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(400, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=20, shuffle=True, generator=gen
    )
    n_epochs = STEPS // len(loader)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for xb, yb in g:
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()


def test_fine_tune_with_frozen_backbone(census):
    census.run(frozen_backbone_loop)
    census.assert_silent()


# ------------------------------------------------ 4. a fine-tune of a converged model


def converged_fine_tune_loop(run_dir: Path) -> None:
    """The model is already converged on this data (its least-squares fit): the loss is
    the noise floor (0.01) from step 1 and only wanders around it, as a fine-tune that
    continues a converged run does."""
    torch.manual_seed(0)
    true = nn.Linear(16, 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1600, 16, generator=gen)
    with torch.no_grad():
        y = true(x) + 0.1 * torch.randn(1600, 4, generator=gen)
    model = nn.Linear(16, 4)
    with torch.no_grad():  # the checkpoint fine-tuned from: the fit of this very data
        fit = torch.linalg.lstsq(torch.cat([x, torch.ones(1600, 1)], 1), y).solution
        model.weight.copy_(fit[:16].T)
        model.bias.copy_(fit[16])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True, generator=gen
    )
    n_epochs = STEPS // len(loader)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for xb, yb in g:
                loss = F.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()


def test_fine_tune_of_a_converged_model(census):
    census.run(converged_fine_tune_loop)
    census.assert_silent()


# ----------------------------------------------------------------------------- 5. a GAN


def gan_loop(run_dir: Path) -> None:
    """A GAN on a ring of 8 Gaussians: G and D with BatchNorm, two optimizers passed by
    name; the losses oscillate around their equilibrium rather than fall."""
    torch.manual_seed(0)
    z_dim = 4
    gen_net = nn.Sequential(
        nn.Linear(z_dim, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 2),
    )  # fmt: skip
    disc = nn.Sequential(nn.Linear(2, 32), nn.BatchNorm1d(32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen_net.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    rng = torch.Generator().manual_seed(1)
    angles = torch.randint(0, 8, (3200,), generator=rng) * (2 * math.pi / 8)
    real = torch.stack([angles.cos(), angles.sin()], 1) * 2 + 0.05 * torch.randn(
        3200, 2, generator=rng
    )
    loader = torch.utils.data.DataLoader(
        real, batch_size=32, shuffle=True, generator=rng, drop_last=True
    )
    n_epochs = STEPS // len(loader)
    bce = nn.BCEWithLogitsLoss()
    with guardrails.guard(
        {"generator": gen_net, "discriminator": disc},
        {"d": opt_d, "g": opt_g},
        loader,
        generators={"rng": rng},
        run_dir=run_dir,
    ) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x in g:
                n = x.shape[0]
                fake = gen_net(torch.randn(n, z_dim))
                d_loss = bce(disc(x), torch.ones(n, 1)) + bce(
                    disc(fake.detach()), torch.zeros(n, 1)
                )
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                g_loss = bce(disc(fake), torch.ones(n, 1))
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
                g.observe(d_loss + g_loss)


def test_gan_two_optimizers_by_name(census):
    census.run(gan_loop)
    census.assert_silent()


# ----------------------------------------------------------------------------- 6. a VAE


class VAE(nn.Module):
    def __init__(self, dim: int = 16, latent: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 2 * latent))
        self.dec = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z), mu, logvar


def vae_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    basis = torch.randn(4, 16, generator=gen)
    data = torch.randn(1600, 4, generator=gen) @ basis + 0.1 * torch.randn(1600, 16, generator=gen)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=gen)
    n_epochs = STEPS // len(loader)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    kl_warmup = 200
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x in g:
                recon, mu, logvar = model(x)
                rec = F.mse_loss(recon, x, reduction="sum") / x.shape[0]
                kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
                beta = min(1.0, g.step / kl_warmup)  # KL warm-up
                loss = rec + beta * kl
                opt.zero_grad()
                loss.backward()
                opt.step()


def test_vae_with_kl_warmup(census):
    census.run(vae_loop)
    census.assert_silent()


# ------------------------------------------------------------------ 7. DDP on 2 gloo ranks


def _ddp_rank(rank: int, port: int, run_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(640, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(640, 1, generator=gen)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    n_epochs = STEPS // len(loader)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    try:
        with guardrails.guard(model, opt, loader, run_dir=run_dir) as g:
            for epoch in range(g.epoch, n_epochs):
                sampler.set_epoch(epoch)
                for xb, yb in g:
                    loss = F.mse_loss(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow(reason="2 real gloo ranks, 600 steps each")
def test_ddp_two_gloo_ranks(census):
    spawn(_ddp_rank, (free_port(), str(census.run_dir)))
    census.assert_silent()
    ends = [e for e in read_events(census.run_dir) if e["kind"] == "end"]
    assert sorted(e["rank"] for e in ends) == [0, 1]


# ------------------------------------------------------------ 8. a loader with 2 workers


class FlippedImages(torch.utils.data.Dataset):
    """Images augmented as they are read (a random horizontal flip), in the workers."""

    def __init__(self, images: torch.utils.data.TensorDataset) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.images[i]
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), y


def loader_workers_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        FlippedImages(_images(640, seed=0, side=16)),
        batch_size=32,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        persistent_workers=True,
    )
    n_epochs = STEPS // len(loader)
    model = SmallConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    with guardrails.guard(model, opt, loader, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x, y in g:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()


@pytest.mark.slow(reason="2 loader worker processes")
def test_dataloader_with_two_workers(census):
    census.run(loader_workers_loop)
    census.assert_silent()


# ------------------------------------------------------------ 9. a loss that goes to ~0


def exact_fit_loop(run_dir: Path) -> None:
    """A regression the model can fit up to a tiny noise: the loss falls to ~1e-7."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 2, generator=gen)
    x = torch.randn(640, 8, generator=gen)
    y = x @ w + 3e-4 * torch.randn(640, 2, generator=gen)  # a noise floor of ~1e-7
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen
    )
    n_epochs = STEPS // len(loader)
    model = nn.Linear(8, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for xb, yb in g:
                loss = F.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    assert final < 1e-6, final


def test_loss_near_zero(census):
    census.run(exact_fit_loop)
    census.assert_silent()


# --------------------------------------------------------------- 10. a loud high-LR run


def high_lr_loop(run_dir: Path) -> None:
    """SGD at a high LR on small batches of a noisy task: a loss that bounces a lot
    from step to step and still trends down."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4800, 20, generator=gen)
    teacher = torch.randn(20, 10, generator=gen)
    y = (x @ teacher + 2.0 * torch.randn(4800, 10, generator=gen)).argmax(1)  # 10 noisy classes
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True, generator=gen
    )
    n_epochs = 1
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # a step-to-step swing of +-0.5
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for xb, yb in g:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()


def test_loud_high_lr_run(census):
    census.run(high_lr_loop)
    census.assert_silent()


# ------------------------------------------------------------------- 11. eval pauses


def eval_pauses_loop(run_dir: Path) -> None:
    """Every 50 steps: model.eval(), the validation loss under no_grad, model.train().
    An EMA of the weights is kept and evaluated too, passed with the model."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    train, val = _images(320, seed=0), _images(64, seed=1)
    loader = torch.utils.data.DataLoader(
        train, batch_size=16, shuffle=True, generator=gen, drop_last=True
    )
    val_loader = torch.utils.data.DataLoader(val, batch_size=32)
    n_epochs = STEPS // len(loader)
    model = SmallConvNet()
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99), use_buffers=True
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    val_losses = []
    with guardrails.guard([model, ema], opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x, y in g:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                if g.step % 50 == 0:
                    model.eval()
                    with torch.no_grad():
                        for net in (model, ema):
                            val_losses.append(
                                sum(F.cross_entropy(net(vx), vy).item() for vx, vy in val_loader)
                            )
                    model.train()
    assert len(val_losses) == 2 * STEPS // 50


def test_eval_pauses_with_an_ema(census):
    census.run(eval_pauses_loop)
    census.assert_silent()


# ---------------------------------------------- 12. an LSTM with clipping, ReduceLROnPlateau


class CharLSTM(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.out(h)


def lstm_plateau_loop(run_dir: Path) -> None:
    """An LSTM on sequences, gradients clipped, the LR cut by ReduceLROnPlateau on the
    epoch's validation loss."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    vocab, length = 12, 12
    start = torch.randint(0, vocab, (960, 1), generator=gen)
    seq = (start + torch.arange(length + 1) * (start % 3 + 1)) % vocab
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(seq[:800, :-1], seq[:800, 1:]),
        batch_size=16,
        shuffle=True,
        generator=gen,
    )
    val_x, val_y = seq[800:, :-1], seq[800:, 1:]
    n_epochs = STEPS // len(loader)
    model = CharLSTM(vocab)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    with guardrails.guard(
        model, opt, loader, scheduler=sched, generators={"gen": gen}, run_dir=run_dir
    ) as g:
        for _epoch in range(g.epoch, n_epochs):
            model.train()
            for x, y in g:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            model.eval()
            with torch.no_grad():
                val = F.cross_entropy(model(val_x).flatten(0, 1), val_y.flatten())
            sched.step(val)


def test_lstm_with_clipping_and_reduce_lr_on_plateau(census):
    census.run(lstm_plateau_loop)
    census.assert_silent()


# -------------------------------------------------- 13. a contrastive, MoCo-style loop


def moco_loop(run_dir: Path) -> None:
    """Two augmented views, a query encoder trained by InfoNCE against a momentum
    (EMA) key encoder that is no optimizer's and a queue of past keys."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(32, 16, generator=gen).repeat(20, 1)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, generator=gen)
    n_epochs = STEPS // len(loader)
    query = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    key = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    key.load_state_dict(query.state_dict())
    key.requires_grad_(False)
    queue = F.normalize(torch.randn(256, 8), dim=1)
    opt = torch.optim.SGD(query.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    with guardrails.guard(
        {"query": query, "key": key}, opt, loader, generators={"gen": gen}, run_dir=run_dir
    ) as g:
        for _epoch in range(g.epoch, n_epochs):
            for x in g:
                q = F.normalize(query(x + 0.1 * torch.randn_like(x)), dim=1)
                with torch.no_grad():
                    for pq, pk in zip(query.parameters(), key.parameters(), strict=True):
                        pk.mul_(0.99).add_(pq.detach(), alpha=0.01)
                    k = F.normalize(key(x + 0.1 * torch.randn_like(x)), dim=1)
                logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / 0.2
                loss = F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))
                opt.zero_grad()
                loss.backward()
                opt.step()
                queue = torch.cat([k, queue])[: len(queue)]


def test_contrastive_moco_style(census):
    census.run(moco_loop)
    census.assert_silent()


# ------------------------------------------------------ 14. torch.compile, aot_eager


def compiled_loop(run_dir: Path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(640, 8, generator=gen)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen
    )
    n_epochs = STEPS // len(loader)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with guardrails.guard(model, opt, loader, generators={"gen": gen}, run_dir=run_dir) as g:
        for _epoch in range(g.epoch, n_epochs):
            for xb, yb in g:
                loss = F.mse_loss(compiled(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()


@pytest.mark.slow(reason="torch.compile's first compilation")
def test_torch_compile_aot_eager(census):
    census.run(compiled_loop)
    census.assert_silent()


# ------------------------------- 15. a sequence-length warm-up under an AMP-style scaler


def seq_warmup_scaler_loop(run_dir: Path) -> None:
    """The LM again, its context grown from 4 to 16 tokens over the first 200 steps
    (shorter sequences, lower loss per token early: the loss moves with the length),
    written for mixed precision: a GradScaler passed to the guard, unscale_ before
    clipping, scaler.step."""
    torch.manual_seed(0)
    vocab, ctx, batch, grow = 16, 16, 8, 200
    gen = torch.Generator().manual_seed(1)

    def get_batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        seq = (start + stride * torch.arange(length + 1)) % vocab
        return seq[:, :-1], seq[:, 1:]

    model = TinyGPT(vocab, ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu")
    length = {"now": 4}
    batches = iter(lambda: get_batch(length["now"]), None)
    with guardrails.guard(
        model, opt, batches, scaler=scaler, generators={"gen": gen}, run_dir=run_dir
    ) as g:
        it = iter(g)
        for step in range(g.step, STEPS):
            length["now"] = min(ctx, 4 + (ctx - 4) * step // grow)
            x, y = next(it)
            _, loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


@pytest.mark.slow(reason="600 steps through a GradScaler's unscale and step")
def test_sequence_length_warmup_with_a_grad_scaler(census):
    census.run(seq_warmup_scaler_loop)
    census.assert_silent()
