"""Training-time RTC's row supervision: every chunk row gets at least the supervision plain training gives it.

Under delay d the chunk's rows j < d are committed (given, not predicted), so row j is predicted only on
the frames with d <= j: under delays uniform over [0, 8], row 0 on 1/9 of them. `vla-rl train` marks
its batches ``ZERO_DELAY_PASS``: the denoising policies also denoise every frame at zero delay (nothing
committed, every row in the loss, its own noise and timestep) and take the mean of the two passes'
losses. Every expected value here is worked out from the definitions, the delay draws and the sample
sizes, not read back from the code under test.
"""

import math

import pytest
import torch
from tiny_policies import ACTION_MAX, ACTION_MIN, TASK, A, H, make_policy

from policies.diffusion import DiffusionConfig
from policies.diffusion.modeling_diffusion import DiffusionPolicy
from policies.pretrained import PreTrainedPolicy
from policies.tokenizer import word_vocabulary
from vla_core.runtime import DelayConfig, DelayModel, committed_prefix
from vla_core.types import ACTION, OBS_COMMITTED_MASK, OBS_DELAY_STEPS, ZERO_DELAY_PASS
from vla_rl.train import with_delay_augmentation

pytestmark = pytest.mark.usefixtures("one_thread")


def training_batch(delays=(2, 1), zero_delay_pass: bool = True) -> dict:
    """Two frames in dataset units, sample 1's episode ending after 4 steps, with `vla-rl train`'s delay
    augmentation for ``delays`` (max delay 3)."""
    g = torch.Generator().manual_seed(3)
    b = len(delays)
    actions = torch.rand(b, H, A, generator=g) * torch.tensor([4.0, 1.0]) + torch.tensor([-2.0, 0.0])
    pad = torch.zeros(b, H, dtype=torch.bool)
    pad[1, 4:] = True
    batch = {"observation.images.front": torch.rand(b, 3, 16, 16, generator=g),
             "observation.state": torch.randn(b, 3, generator=g), "task": [TASK] * b,
             ACTION: actions, "action_is_pad": pad}  # fmt: skip
    batch = with_delay_augmentation(batch, torch.tensor(delays), 3)
    if not zero_delay_pass:
        batch.pop(ZERO_DELAY_PASS)
    return batch


def normalized(actions: torch.Tensor) -> torch.Tensor:
    low, high = torch.tensor(ACTION_MIN), torch.tensor(ACTION_MAX)
    return (actions - low) / (high - low) * 2 - 1


# Delays 2 and 1: known rows of the delayed pass; the zero-delay pass knows none.
KNOWN = torch.tensor([[True, True, False, False, False, False], [True, False, False, False, False, False]])
VALID = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])


def test_train_batches_ask_for_the_zero_delay_pass():
    batch = training_batch()
    assert batch[ZERO_DELAY_PASS] is True
    assert torch.equal(batch[OBS_COMMITTED_MASK], KNOWN[:, :3])


@pytest.mark.parametrize("kind", ["diffusion", "diffusion-flow"])
def test_diffusion_denoises_each_frame_under_its_delay_and_at_zero_delay(kind, monkeypatch):
    policy = make_policy(kind, max_delay_steps=3).train()
    seen = {}

    def zero_denoiser(noisy, t, cond, known=None):
        seen.update(noisy=noisy, t=t, cond=cond, known=known)
        return torch.zeros_like(noisy)

    monkeypatch.setattr(policy, "denoise", zero_denoiser)
    batch = training_batch()
    loss = policy(batch, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # forward()'s draws: noise and a timestep for 2B chunks
    noise = torch.randn(4, H, A, generator=g)
    clean = normalized(batch[ACTION]).repeat(2, 1, 1)
    if kind == "diffusion-flow":  # t ~ U(0, 1), x_t = t noise + (1 - t) x_0, the velocity noise - x_0 regressed
        t = torch.rand(4, generator=g)
        noised = t[:, None, None] * noise + (1 - t[:, None, None]) * clean
        regress = noise - clean
    else:  # DDPM: sqrt(a) x_0 + sqrt(1 - a) noise, the noise regressed
        t = torch.randint(0, 100, (4,), generator=g)
        alpha_bar = policy.train_scheduler.alphas_cumprod[t][:, None, None]
        noised = alpha_bar.sqrt() * clean + (1 - alpha_bar).sqrt() * noise
        regress = noise
    per_row = (regress**2).mean(-1)  # the error of predicting zeros
    # Delayed pass (chunks 0-1): sample 0 rows 2-5, sample 1 rows 1-3. Zero-delay pass (chunks 2-3):
    # sample 0 rows 0-5, sample 1 rows 0-3, as plain training takes them.
    delayed = (per_row[0, 2:].sum() + per_row[1, 1:4].sum()) / 7
    at_zero = (per_row[2].sum() + per_row[3, :4].sum()) / 10
    assert loss.item() == pytest.approx(((delayed + at_zero) / 2).item(), rel=1e-6)
    assert torch.equal(seen["t"], t) and torch.equal(seen["cond"][:2], seen["cond"][2:])  # one encoding
    assert torch.equal(seen["known"], torch.cat([KNOWN, torch.zeros_like(KNOWN)]))
    torch.testing.assert_close(seen["noisy"][:2], torch.where(KNOWN[..., None], clean[:2], noised[:2]))
    torch.testing.assert_close(seen["noisy"][2:], noised[2:])  # nothing known: all noised


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_vla_adds_the_zero_delay_pass_as_k_more_copies(objective, monkeypatch):
    policy = make_policy(objective, max_delay_steps=3).train()
    seen = {}

    def zero_dit(noisy, t, cond, cond_mask, known=None):
        seen.update(noisy=noisy, t=t, known=known)
        return torch.zeros_like(noisy)

    monkeypatch.setattr(policy.dit, "forward", zero_dit)
    batch, k = training_batch(), 2
    loss = policy(batch, torch.Generator().manual_seed(0), copies=k)
    g = torch.Generator().manual_seed(0)  # forward()'s draws: 2K copies of each condition
    noise = torch.randn(2, 2 * k, H, A, generator=g)
    clean = normalized(batch[ACTION])[:, None]
    if objective == "flow":
        t = torch.rand(2, 2 * k, generator=g)
        regress = noise - clean
        tt = t[..., None, None]
        noised = tt * noise + (1 - tt) * clean
    else:
        t = torch.randint(0, 100, (2, 2 * k), generator=g).float()
        regress = noise
        alpha_bar = policy.train_scheduler.alphas_cumprod[t.long()][..., None, None]
        noised = alpha_bar.sqrt() * clean + (1 - alpha_bar).sqrt() * noise
    # Copies 0..K-1 share the frame's committed prefix; copies K..2K-1 know nothing.
    known = torch.cat([KNOWN[:, None].expand(2, k, H), torch.zeros(2, k, H, dtype=torch.bool)], 1)
    err = (regress**2).mean(-1)  # (B, 2K, H)
    delayed_rows = (VALID & ~KNOWN)[:, None].expand(2, k, H)
    at_zero_rows = VALID[:, None].expand(2, k, H)
    delayed = (err[:, :k] * delayed_rows).sum() / delayed_rows.sum()
    at_zero = (err[:, k:] * at_zero_rows).sum() / at_zero_rows.sum()
    assert loss.item() == pytest.approx(((delayed + at_zero) / 2).item(), rel=1e-6)
    assert torch.equal(seen["known"], known)
    torch.testing.assert_close(seen["t"], torch.where(known, 0.0, t[..., None].expand(2, 2 * k, H)))
    torch.testing.assert_close(seen["noisy"], torch.where(known[..., None], clean.expand(2, 2 * k, H, A), noised))


def test_the_validation_loss_is_trainings_with_the_zero_delay_pass():
    from vla_rl.train import validation_loss

    class Demos:  # the two frames of training_batch, as ChunkedDemos.batch gives them (without the augmentation)
        def batch(self, idx, horizon):
            full = training_batch()
            return {k: (v[idx] if torch.is_tensor(v) else [v[i] for i in idx.tolist()])
                    for k, v in full.items() if not k.startswith("observation.committed") and k not in
                    (OBS_DELAY_STEPS, ZERO_DELAY_PASS)}  # fmt: skip

    policy = make_policy("diffusion", max_delay_steps=3)
    got = validation_loss(policy, Demos(), torch.arange(2), H, seed=5, delays=torch.tensor([2, 1]))
    marked, unmarked = training_batch(), training_batch(zero_delay_pass=False)
    assert got == policy(marked, torch.Generator().manual_seed(5)).item()
    assert got != policy(unmarked, torch.Generator().manual_seed(5)).item()


@pytest.mark.parametrize("kind", ["diffusion", "diffusion-flow", "flow", "ddpm"])
def test_without_the_mark_or_without_delays_the_loss_is_the_old_one_bit_for_bit(kind):
    copies = 1 if kind.startswith("diffusion") else 2

    def loss(policy, batch):
        return policy.train()(batch, torch.Generator().manual_seed(0), copies=copies)

    marked, unmarked = training_batch(), training_batch(zero_delay_pass=False)
    bare = {k: v for k, v in unmarked.items() if not k.startswith("observation.committed") and k != OBS_DELAY_STEPS}
    # max_delay_steps = 0: the augmentation and the mark are ignored; the loss of the bare batch.
    plain = make_policy(kind)
    assert torch.equal(loss(plain, marked), loss(plain, bare))
    # A policy that reads the augmentation takes the delayed pass alone without the mark (as before; its
    # value is worked out by hand in test_training_rtc.py) and adds the zero-delay pass with it.
    reading = make_policy(kind, max_delay_steps=3)
    assert not torch.equal(loss(reading, marked), loss(reading, unmarked))  # the mark is read


def test_each_row_gets_at_least_its_plain_supervision_under_uniform_delays():
    """36,000 frames, chunks of 16, delays uniform over [0, 8]. Plain training puts every row of every
    frame in the loss (share 1/16 each). The delayed pass alone (the old method) has row j in it with
    probability p_j = P(d <= j): row 0 on 1/9 of the frames and (1/9) / 12 of the loss. With the
    zero-delay pass every row is in it on every frame, and its share is at least half plain's."""
    horizon, high, n = 16, 8, 36_000
    delay = DelayModel(DelayConfig(kind="uniform", high=high, seed=3))
    d = delay.sample(n)
    pad = torch.zeros(n, horizon, dtype=torch.bool)
    batch = with_delay_augmentation({ACTION: torch.zeros(n, horizon, A), "action_is_pad": pad}, d, high)
    known = torch.zeros(n, horizon, dtype=torch.bool)
    known[:, :high] = batch[OBS_COMMITTED_MASK]
    counts = torch.tensor([(d <= j).sum().item() for j in range(horizon)], dtype=torch.float64)  # C_j

    def shares(zero_delay_pass: bool) -> torch.Tensor:
        # With an error of 1 on row j and 0 elsewhere the loss is row j's share of it.
        one_hot = torch.eye(horizon)[:, None].expand(horizon, n, horizon)
        at_zero = (lambda j: one_hot[j]) if zero_delay_pass else (lambda j: None)
        return torch.stack(
            [PreTrainedPolicy.chunk_loss(one_hot[j], batch, known, at_zero_delay=at_zero(j)) for j in range(horizon)]
        ).double()

    new, old = shares(True), shares(False)
    # Exactly, from the drawn delays: old share C_j / sum C; new share (1/16 + C_j / sum C) / 2.
    torch.testing.assert_close(old, counts / counts.sum())
    torch.testing.assert_close(new, (1 / horizon + counts / counts.sum()) / 2)
    assert (new >= 0.5 / horizon - 1e-9).all() and new[:4].sum() >= 0.125  # rows 0-3: 25% in plain training
    # Per frame the old method supervised row 0 C_0 / n times, about 1/9 (plain training: once; now 1 + C_0 / n).
    assert counts[0] / n < 0.13
    # The old shares against the distribution: p_j / 12 (sum of p_j = 4 + 8), five standard deviations
    # of the binomial count C_j and of the total, n frames of 16 - d rows each (Var d = (9^2 - 1) / 12).
    p = torch.tensor([(j + 1) / 9 for j in range(high)] + [1.0] * (horizon - high), dtype=torch.float64)
    sd_total = math.sqrt(n * (9**2 - 1) / 12) / (12 * n)
    tolerance = 5 * ((n * p * (1 - p)).sqrt() / (12 * n) + p / 12 * sd_total)
    assert ((old - p / 12).abs() <= tolerance).all(), (old, p / 12, tolerance)
    assert old[0] < 0.2 / horizon and old[:4].sum() < 0.1  # row 0 (1/9) / 12: 0.148 of plain's share; rows 0-3: 9%


# -- what the policy learns: the rows zero delay runs first, against the plain policy ------------------

# A chunk is a smooth curve (a quadratic per action dimension) fixed by the observation's state, so a
# trained policy predicts it from the observation alone, at zero delay. One small diffusion policy is
# trained three times from the same seed on the same frames and delays: plain, with delays uniform over
# [0, 8] as `vla-rl train` builds its batches, and the same without the zero-delay pass (the old method).
STEPS, FRAMES, HORIZON, DELAY = 800, 256, 16, 8


def _curves(state: torch.Tensor) -> torch.Tensor:
    """(n, 3) states in [-1, 1] -> (n, HORIZON, 2) chunks in [-2, 2]: x(s) = a + 2 b s + 2 c s^2, s = j / H."""
    s = (torch.arange(HORIZON).float() / HORIZON)[None, :, None]
    x = state[:, :1, None] + 2 * state[:, 1:2, None] * s + 2 * state[:, 2:3, None] * s**2
    return torch.cat([x, -x], -1)


def _observation(state: torch.Tensor) -> dict:
    n = len(state)
    return {"observation.images.front": torch.zeros(n, 3, 8, 8), "observation.state": state, "task": ["go"] * n}


def _train_and_measure(delay: DelayModel | None, zero_delay_pass: bool = True) -> torch.Tensor:
    """(HORIZON,) each row's mean absolute error (normalized units) of chunks sampled at zero delay on
    the training frames, with the same sampling noise for every policy."""
    state = torch.rand(FRAMES, 3, generator=torch.Generator().manual_seed(0)) * 2 - 1
    actions, pad = _curves(state), torch.zeros(FRAMES, HORIZON, dtype=torch.bool)
    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionConfig(
        state_dim=3, action_dim=2, cameras=["front"], image_size=8, horizon=HORIZON, n_action_steps=4,
        vocabulary=word_vocabulary(["go"]), vision_channels=8, num_keypoints=4, text_dim=8, hidden_dim=64,
        num_blocks=2, max_delay_steps=delay.max_steps if delay else 0,
    ))  # fmt: skip
    policy.set_normalization([0.0] * 3, [1.0] * 3, [-2.0, -2.0], [2.0, 2.0])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, FRAMES, (64,), generator=g)
        batch = {**_observation(state[idx]), ACTION: actions[idx], "action_is_pad": pad[idx]}
        if delay is not None:
            batch = with_delay_augmentation(batch, delay.sample(64), delay.max_steps)
            if not zero_delay_pass:
                batch.pop(ZERO_DELAY_PASS)
        loss = policy.train()(batch, g)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
    obs = _observation(state)
    if delay is not None:  # zero delay, announced as the shell announces it: nothing committed
        obs.update(committed_prefix(actions, pad, torch.zeros(FRAMES, dtype=torch.long), delay.max_steps))
    noise = torch.randn(FRAMES, HORIZON, 2, generator=torch.Generator().manual_seed(3))
    chunk = policy.eval().predict_chunk(obs, noise=noise).actions
    return (policy.normalize_action(chunk) - policy.normalize_action(actions)).abs().mean(-1).mean(0)


def test_rows_run_at_zero_delay_are_learned_as_well_as_by_the_plain_policy():
    uniform = DelayConfig(kind="uniform", high=DELAY)
    plain = _train_and_measure(None)
    new = _train_and_measure(DelayModel(uniform))
    old = _train_and_measure(DelayModel(uniform), zero_delay_pass=False)
    first = slice(0, 4)
    print(f"rows 0-3 error at zero delay: plain {plain[first].tolist()}, new {new[first].tolist()}, "
          f"old {old[first].tolist()}")  # fmt: skip
    assert (new[first] <= 1.5 * plain[first]).all(), (new, plain)
    assert old[first].mean() >= 1.4 * new[first].mean(), (old, new)  # the old method was worse
