"""Training-time RTC: policies that read the delay augmentation (committed actions), and `vla-rl train --delay.*`.

Every expected value is worked out here from the definitions (the clean prefix, the masked loss, the
delay draws), not read back from the code under test.
"""

import json

import pytest
import torch
from tiny_policies import ACTION_MAX, ACTION_MIN, TASK, A, H, make_policy

from policies.diffusion import DiffusionConfig
from policies.diffusion.modeling_diffusion import DiffusionPolicy
from policies.pretrained import PreTrainedPolicy
from policies.tokenizer import word_vocabulary
from vla_core.types import OBS_COMMITTED_ACTIONS, OBS_COMMITTED_MASK, OBS_DELAY_STEPS

KINDS = ["diffusion", "diffusion-flow", "flow", "ddpm"]  # the small policy and the VLA, each objective


def observation(b: int = 2) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"observation.images.front": torch.rand(b, 3, 16, 16, generator=g),
            "observation.state": torch.randn(b, 3, generator=g), "task": [TASK] * b}  # fmt: skip


def normalized(actions: torch.Tensor) -> torch.Tensor:
    """Dataset units -> [-1, 1] with the min/max above, written out."""
    low, high = torch.tensor(ACTION_MIN), torch.tensor(ACTION_MAX)
    return (actions - low) / (high - low) * 2 - 1


# Sample 0 has a delay of 2 (row 2 is padding with a value that must never be read), sample 1 of 3.
# 3.0 is outside the action range [-2, 2]: the chunk must still return it exactly, unclamped.
COMMITTED = torch.tensor([[[0.5, 0.25], [-1.5, 0.9], [9.0, 9.0]], [[1.9, 0.1], [3.0, 0.7], [-0.3, 0.3]]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
KNOWN = torch.tensor([[True, True, False, False, False, False], [True, True, True, False, False, False]])


def augmentation(committed=COMMITTED, mask=MASK) -> dict:
    return {OBS_COMMITTED_ACTIONS: committed, OBS_COMMITTED_MASK: mask, OBS_DELAY_STEPS: mask.sum(1)}


def chunk(policy, obs, noise):
    torch.manual_seed(7)  # the ddpm objective's DDIM sampler draws nothing, but keep every run identical
    return policy.predict_chunk(obs, noise=noise).actions


# -- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_conditioned_chunk_starts_with_the_committed_actions_and_continues_from_them(kind):
    policy = make_policy(kind, max_delay_steps=3)
    obs, noise = observation(), torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    free = chunk(policy, obs, noise)
    conditioned = chunk(policy, {**obs, **augmentation()}, noise)
    # The known steps are the committed actions, bit for bit.
    assert torch.equal(conditioned[0, :2], COMMITTED[0, :2]) and torch.equal(conditioned[1, :3], COMMITTED[1, :3])
    # The rest is sampled from the same noise but continues the committed prefix: it differs from the
    # free chunk, and it moves with the committed values.
    moved = chunk(policy, {**obs, **augmentation(COMMITTED * 0.5)}, noise)
    for b in range(2):
        assert (conditioned[b][~KNOWN[b]] - free[b][~KNOWN[b]]).abs().max() > 1e-2, b
        assert (conditioned[b][~KNOWN[b]] - moved[b][~KNOWN[b]]).abs().max() > 1e-3, b
    # What the mask leaves out is never read; an all-False mask is the same as no augmentation.
    other_padding = COMMITTED.clone()
    other_padding[0, 2] = -7.0
    assert torch.equal(chunk(policy, {**obs, **augmentation(other_padding)}, noise), conditioned)
    nothing = chunk(policy, {**obs, **augmentation(mask=torch.zeros(2, 3, dtype=torch.bool))}, noise)
    torch.testing.assert_close(nothing, free, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["flow", "diffusion-flow"])
def test_inpainting_guidance_still_works_with_a_committed_prefix(kind):
    """Flow RTC guidance toward a target on the steps after the prefix, on top of the conditioning."""
    policy = make_policy(kind, max_delay_steps=3)
    obs, noise = observation(), torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    obs = {**obs, **augmentation()}
    target = torch.tensor([[1.0, 0.5]]).expand(2, H, A)  # dataset units
    weights = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 0.0]]).expand(2, H)
    plain = chunk(policy, obs, noise)
    torch.manual_seed(7)
    guided = policy.predict_chunk(obs, noise=noise, inpaint=(target, weights)).actions
    assert torch.equal(guided[1, :3], COMMITTED[1, :3])  # the prefix is still exact
    plain_err, guided_err = ((x[:, 3:5] - target[:, 3:5]).abs().mean() for x in (plain, guided))
    assert guided_err < 0.5 * plain_err, (guided_err, plain_err)


# -- the loss --------------------------------------------------------------------------------------


def training_batch(b: int = 2) -> dict:
    """Actions in dataset units; sample 1's episode ends after 4 steps; committed = the known prefix."""
    g = torch.Generator().manual_seed(3)
    actions = torch.rand(b, H, A, generator=g) * torch.tensor([4.0, 1.0]) + torch.tensor([-2.0, 0.0])
    pad = torch.zeros(b, H, dtype=torch.bool)
    pad[1, 4:] = True
    mask = torch.tensor([[True, True, False], [True, False, False]])  # delays 2 and 1
    return {**observation(b), "action": actions, "action_is_pad": pad,
            **augmentation(actions[:, :3] * mask[..., None], mask)}  # fmt: skip


KNOWN_IN_BATCH = torch.tensor([[True, True, False, False, False, False], [True, False, False, False, False, False]])


def test_diffusion_loss_is_taken_on_the_unknown_steps_and_the_known_ones_enter_clean(monkeypatch):
    policy = make_policy("diffusion", max_delay_steps=3).train()
    seen = {}

    def zero_denoiser(noisy, t, cond, known=None):
        seen.update(noisy=noisy, t=t, known=known)
        return torch.zeros_like(noisy)

    monkeypatch.setattr(policy, "denoise", zero_denoiser)
    batch = training_batch()
    loss = policy(batch, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # forward()'s draws: the noise, then one timestep per frame
    noise = torch.randn(2, H, A, generator=g)
    t = torch.randint(0, 100, (2,), generator=g)
    per_step = (noise**2).mean(-1)  # the error of predicting zero noise
    # Unknown and not padding: sample 0 steps 2..5 (4), sample 1 steps 1..3 (3).
    expected = (per_step[0, 2:].sum() + per_step[1, 1:4].sum()) / 7
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(seen["known"], KNOWN_IN_BATCH) and torch.equal(seen["t"], t)
    clean = normalized(batch["action"])
    alpha_bar = policy.train_scheduler.alphas_cumprod[t][:, None, None]  # DDPM: sqrt(a) x + sqrt(1 - a) eps
    noised = alpha_bar.sqrt() * clean + (1 - alpha_bar).sqrt() * noise
    torch.testing.assert_close(seen["noisy"], torch.where(KNOWN_IN_BATCH[..., None], clean, noised))


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_vla_loss_copies_share_the_clean_prefix_with_a_clean_timestep(objective, monkeypatch):
    policy = make_policy(objective, max_delay_steps=3).train()
    seen = {}

    def zero_dit(noisy, t, cond, cond_mask, known=None):
        seen.update(noisy=noisy, t=t, known=known)
        return torch.zeros_like(noisy)

    monkeypatch.setattr(policy.dit, "forward", zero_dit)
    batch, k = training_batch(), 3
    loss = policy(batch, torch.Generator().manual_seed(0), copies=k)
    g = torch.Generator().manual_seed(0)  # forward()'s draws: the noise, then one timestep per copy
    noise = torch.randn(2, k, H, A, generator=g)
    clean = normalized(batch["action"])[:, None]  # (B, 1, H, A)
    if objective == "flow":
        t = torch.rand(2, k, generator=g)
        regress = noise - clean  # velocity
        tt = t[..., None, None]
        noised = tt * noise + (1 - tt) * clean
    else:
        t = torch.randint(0, 100, (2, k), generator=g).float()
        regress = noise
        alpha_bar = policy.train_scheduler.alphas_cumprod[t.long()][..., None, None]
        noised = alpha_bar.sqrt() * clean + (1 - alpha_bar).sqrt() * noise
    known = KNOWN_IN_BATCH[:, None].expand(2, k, H)  # every copy of a frame shares its prefix
    valid = ~batch["action_is_pad"][:, None] & ~known
    expected = ((regress**2).mean(-1) * valid).sum() / valid.sum()
    assert valid.sum() == 7 * k and loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(seen["known"], known)
    torch.testing.assert_close(seen["t"], torch.where(known, 0.0, t[..., None].expand(2, k, H)))  # known: clean, 0
    torch.testing.assert_close(seen["noisy"], torch.where(known[..., None], clean.expand(2, k, H, A), noised))


@pytest.mark.parametrize("kind", KINDS)
def test_the_loss_does_not_depend_on_the_targets_of_known_steps_but_reads_the_committed_ones(kind):
    policy = make_policy(kind, max_delay_steps=3).train()
    copies = 1 if kind.startswith("diffusion") else 2
    batch = training_batch()

    def loss(b):
        return policy(b, torch.Generator().manual_seed(0), copies=copies).item()

    moved_targets = {**batch, "action": batch["action"].clone()}
    moved_targets["action"][KNOWN_IN_BATCH] += 0.5  # only where the step is known
    assert loss(moved_targets) == loss(batch)
    moved_committed = {**batch, OBS_COMMITTED_ACTIONS: batch[OBS_COMMITTED_ACTIONS] + 0.5}
    assert abs(loss(moved_committed) - loss(batch)) > 1e-6  # the network reads the committed actions


# -- without the augmentation: today's policies ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_max_delay_steps_zero_ignores_the_augmentation_and_keeps_todays_parameters(kind):
    plain, reading = make_policy(kind), make_policy(kind, max_delay_steps=3)
    obs, noise = observation(), torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    assert torch.equal(chunk(plain, {**obs, **augmentation()}, noise), chunk(plain, obs, noise))
    batch = training_batch()
    without = {k: v for k, v in batch.items() if not k.startswith("observation.committed") and k != OBS_DELAY_STEPS}
    plain.train()
    copies = 1 if kind.startswith("diffusion") else 2
    losses = [plain(b, torch.Generator().manual_seed(0), copies=copies).item() for b in (batch, without)]
    assert losses[0] == losses[1]
    shapes = {name: tuple(p.shape) for name, p in plain.state_dict().items()}
    extra = {name: tuple(p.shape) for name, p in reading.state_dict().items() if shapes.get(name) != tuple(p.shape)}
    if kind.startswith("diffusion"):  # the MLP's input: the flattened chunk, plus one known flag per step
        assert shapes["input_proj.weight"] == (32, H * A) and extra == {"input_proj.weight": (32, H * (A + 1))}
    else:  # the DiT: one learned known-token embedding, nothing else
        assert "dit.known_embedding" not in shapes and extra == {"dit.known_embedding": (32,)}
    assert set(shapes) <= set(reading.state_dict())


@pytest.mark.parametrize("kind", ["diffusion", "flow"])
def test_a_config_json_without_max_delay_steps_loads_as_zero_and_predicts_the_same(kind, tmp_path):
    """As a checkpoint written before the field existed."""
    policy = make_policy(kind)
    policy.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.pop("max_delay_steps") == 0
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = PreTrainedPolicy.from_pretrained(tmp_path)
    obs, noise = observation(), torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    assert loaded.config.max_delay_steps == 0
    assert torch.equal(chunk(loaded, obs, noise), chunk(policy, obs, noise))


# -- what the policy accepts -----------------------------------------------------------------------


def test_a_delay_past_max_delay_steps_is_refused_naming_the_fix_and_a_wider_empty_mask_is_accepted():
    policy = make_policy("diffusion", max_delay_steps=2)
    obs, noise = observation(), torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    fix = r"trained for delays up to max_delay_steps=2; keep the delay at or below 2 or retrain with --delay.kind=uniform --delay.high=3"
    with pytest.raises(ValueError, match=fix):
        policy.predict_chunk({**obs, **augmentation()}, noise=noise)  # sample 1 commits step 2
    with pytest.raises(ValueError, match=fix):
        policy.train()({**training_batch(), **augmentation()})  # training reads it the same way
    policy.eval()
    # D_max = 4 (the runtime's delay model reaches further) but nothing committed past step 1: accepted.
    wide = torch.full((2, 4, A), 5.0)  # rows past the mask hold anything
    wide[:, :2] = COMMITTED[:, :2]
    wide_mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    narrow = chunk(policy, {**obs, **augmentation(COMMITTED[:, :2], wide_mask[:, :2])}, noise)
    assert torch.equal(chunk(policy, {**obs, **augmentation(wide, wide_mask)}, noise), narrow)
    assert torch.equal(narrow[1, :1], COMMITTED[1, :1]) and not torch.equal(narrow[1, 1], COMMITTED[1, 1])


def test_max_delay_steps_must_leave_a_step_to_predict():
    with pytest.raises(ValueError, match=r"policy.max_delay_steps=6 must be in \[0, horizon=6\)"):
        make_policy("diffusion", max_delay_steps=6)
    with pytest.raises(ValueError, match=r"policy.max_delay_steps=-1 must be in \[0, horizon=6\)"):
        make_policy("flow", max_delay_steps=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_keep_max_delay_steps_and_the_conditioned_chunk(kind, tmp_path):
    policy = make_policy(kind, max_delay_steps=3)
    policy.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["max_delay_steps"] == 3
    loaded = PreTrainedPolicy.from_pretrained(tmp_path)
    obs, noise = {**observation(), **augmentation()}, torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    assert loaded.config.max_delay_steps == 3
    assert torch.equal(chunk(loaded, obs, noise), chunk(policy, obs, noise))


def test_lerobot_reads_max_delay_steps_and_conditions_the_same(tmp_path):
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    policy = make_policy("diffusion", max_delay_steps=3)
    policy.save_pretrained(tmp_path)
    config = PreTrainedConfig.from_pretrained(tmp_path)
    assert config.max_delay_steps == 3
    theirs = get_policy_class(config.type).from_pretrained(tmp_path)
    obs, noise = {**observation(), **augmentation()}, torch.randn(2, H, A, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(theirs.predict_action_chunk(obs, noise=noise), chunk(policy, obs, noise), rtol=0, atol=0)


# -- learning: the continuation is only predictable from the committed prefix ----------------------


def test_a_trained_conditioned_policy_continues_the_committed_prefix():
    """Chunks are straight lines with a random start and slope; the observation says nothing about
    them. Two committed actions determine the line, so a policy that reads them predicts the rest;
    with the augmentation withheld it can only guess a line."""
    from vla_core.runtime import DelayConfig, DelayModel, committed_prefix

    def lines(n, g):
        start = torch.rand(n, 1, 1, generator=g) - 0.5
        slope = (torch.rand(n, 1, 1, generator=g) - 0.5) * 0.3
        return start + slope * torch.arange(H).view(1, H, 1)  # (n, H, 1), within [-1.25, 1.25]

    def blank(n):
        return {"observation.images.front": torch.zeros(n, 3, 8, 8), "observation.state": torch.zeros(n, 1),
                "task": ["go"] * n}  # fmt: skip

    torch.manual_seed(0)
    policy = DiffusionPolicy(DiffusionConfig(
        state_dim=1, action_dim=1, cameras=["front"], image_size=8, horizon=H, n_action_steps=2,
        vocabulary=word_vocabulary(["go"]), vision_channels=8, num_keypoints=4, text_dim=8, hidden_dim=64,
        num_blocks=2, max_delay_steps=3,
    ))  # fmt: skip
    policy.set_normalization([0.0], [1.0], [-1.5], [1.5])
    delays = DelayModel(DelayConfig(kind="uniform", low=2, high=3))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        actions, pad = lines(64, g), torch.zeros(64, H, dtype=torch.bool)
        batch = {**blank(64), "action": actions, "action_is_pad": pad,
                 **committed_prefix(actions, pad, delays.sample(64), 3)}  # fmt: skip
        loss = policy(batch, g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.eval()
    actions = lines(64, torch.Generator().manual_seed(9))
    noise = torch.randn(64, H, 1, generator=torch.Generator().manual_seed(3))
    given = committed_prefix(actions, torch.zeros(64, H, dtype=torch.bool), torch.full((64,), 2), 3)
    conditioned = policy.predict_chunk({**blank(64), **given}, noise=noise).actions
    withheld = policy.predict_chunk(blank(64), noise=noise).actions
    conditioned_err = (conditioned[:, 2:] - actions[:, 2:]).abs().mean().item()
    withheld_err = (withheld[:, 2:] - actions[:, 2:]).abs().mean().item()
    # A line guessed without its prefix is off by ~0.4 per step on average here.
    assert withheld_err > 0.25 and conditioned_err < 0.3 * withheld_err, (conditioned_err, withheld_err)


# -- vla-rl train --delay.* ------------------------------------------------------------------------


def _train_args(dataset, out, steps, *extra):
    return ["train", f"--dataset.root={dataset}", f"--output_dir={out}", f"--steps={steps}", "--save_every=100",
            "--log_every=1", "--batch_size=16", "--log_with=none", "--num_threads=1", "--warmup_steps=2",
            "--lr_schedule=constant_with_warmup", "--policy.hidden_dim=64", "--policy.vision_channels=16",
            *extra]  # fmt: skip


def _record_batches(monkeypatch) -> list[dict]:
    """Every training batch DiffusionPolicy.forward gets, from here on."""
    seen, loss = [], DiffusionPolicy.forward

    def recording(self, batch, generator=None, copies=1):
        seen.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
        return loss(self, batch, generator, copies)

    monkeypatch.setattr(DiffusionPolicy, "forward", recording)
    return seen


def test_train_with_a_uniform_delay_adds_the_committed_prefix_and_saves_max_delay_steps(
    tiny_dataset, tmp_path, monkeypatch
):
    from vla_rl.checkpoint import resolve_policy_dir
    from vla_rl.cli import main

    seen = _record_batches(monkeypatch)
    out = tmp_path / "run"
    assert main(_train_args(tiny_dataset[0], out, 4, "--delay.kind=uniform", "--delay.high=3")) == 0
    assert json.loads((resolve_policy_dir(out) / "config.json").read_text())["max_delay_steps"] == 3
    saved = json.loads((out / "train_config.json").read_text())["delay"]
    assert (saved["kind"], saved["low"], saved["high"]) == ("uniform", 0, 3)
    # The delays: the delay model's uniform draws over [0, 3] from its generator seeded with delay.seed = 0.
    g = torch.Generator().manual_seed(0)
    assert len(seen) == 4
    for batch in seen:
        d = batch[OBS_DELAY_STEPS]
        assert torch.equal(d, torch.randint(0, 4, (16,), generator=g))
        rows = torch.arange(3)[None]
        expected_mask = (rows < d[:, None]) & ~batch["action_is_pad"][:, :3]
        assert torch.equal(batch[OBS_COMMITTED_MASK], expected_mask)
        committed = torch.where(expected_mask[..., None], batch["action"][:, :3], 0.0)
        assert torch.equal(batch[OBS_COMMITTED_ACTIONS], committed)
    assert {int(v) for b in seen for v in b[OBS_DELAY_STEPS]} == {0, 1, 2, 3}


def test_a_resumed_delay_run_draws_the_same_delays_and_loss_curve(tiny_dataset, tmp_path, monkeypatch):
    from vla_rl.cli import main

    delay = ("--delay.kind=uniform", "--delay.high=3", "--delay.seed=5")
    seen = _record_batches(monkeypatch)
    assert main(_train_args(tiny_dataset[0], tmp_path / "ref", 6, *delay)) == 0
    reference = [b[OBS_DELAY_STEPS] for b in seen]
    seen.clear()
    run = tmp_path / "run"
    assert main(_train_args(tiny_dataset[0], run, 3, *delay)) == 0
    assert main(_train_args(tiny_dataset[0], run, 6, *delay, "--resume=true")) == 0
    assert len(seen) == 6
    for step, (got, want) in enumerate(zip([b[OBS_DELAY_STEPS] for b in seen], reference, strict=True)):
        assert torch.equal(got, want), step
    a = json.loads((tmp_path / "ref" / "train_summary.json").read_text())["loss_curve"]
    b = json.loads((run / "train_summary.json").read_text())["loss_curve"]
    assert [s for s, _ in b] == [1, 2, 3, 4, 5, 6]
    assert [loss for _, loss in b] == pytest.approx([loss for _, loss in a], rel=1e-5)


def test_a_delay_run_resumes_only_with_its_own_largest_delay(tiny_dataset, tmp_path, capsys):
    """The network of a policy that reads the augmentation depends on max_delay_steps: resuming with
    another --delay (or none) is refused in one line, before any state is loaded."""
    from vla_rl.cli import main

    run = tmp_path / "run"
    assert main(_train_args(tiny_dataset[0], run, 2, "--delay.kind=uniform", "--delay.high=3")) == 0
    capsys.readouterr()
    for other in (("--delay.kind=uniform", "--delay.high=4"), ()):
        assert main(_train_args(tiny_dataset[0], run, 4, *other, "--resume=true")) == 2
        err = capsys.readouterr().err
        reaches = 4 if other else 0
        assert f"trained with delays up to 3 control steps but --delay reaches {reaches}" in err, err


def test_train_replays_a_latency_file_measured_at_the_datasets_rate(tiny_dataset, tmp_path, capsys):
    """The tiny dataset is recorded at 20 fps: a log measured at 20 Hz trains (0.04 s and 0.12 s are 1 and
    3 steps: max_delay_steps 3); a log measured at 100 Hz is refused."""
    from vla_rl.checkpoint import resolve_policy_dir
    from vla_rl.cli import main

    def log(name, control_dt):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"latency_s": x, "control_dt": control_dt}) + "\n" for x in (0.04, 0.12)))
        return f"--delay.latencies_file={path}"

    out = tmp_path / "run"
    assert main(_train_args(tiny_dataset[0], out, 2, "--delay.kind=histogram", log("20hz.jsonl", 0.05))) == 0
    assert json.loads((resolve_policy_dir(out) / "config.json").read_text())["max_delay_steps"] == 3
    capsys.readouterr()
    args = _train_args(tiny_dataset[0], tmp_path / "other", 2, "--delay.kind=histogram", log("100hz.jsonl", 0.01))
    assert main(args) == 2
    assert "measured at a control period of 0.01 s but the delays are counted in steps of 0.05 s" in (
        capsys.readouterr().err
    )


def test_train_refuses_a_delay_of_a_whole_chunk_before_reading_any_data(tmp_path, capsys):
    from vla_rl.cli import main

    nowhere, out = tmp_path / "nowhere", tmp_path / "run"
    args = ["train", f"--dataset.root={nowhere}", f"--output_dir={out}", "--policy.horizon=8"]
    assert main([*args, "--delay.kind=uniform", "--delay.high=8"]) == 2
    err = capsys.readouterr().err
    assert "reaches 8 control steps but a chunk holds 8" in err and "--policy.horizon" in err
    assert main([*args, "--delay.kind=fixed", "--delay.steps=3", "--policy.max_delay_steps=2"]) == 2
    assert "policy.max_delay_steps=2 but the delay model reaches 3 steps; drop --policy.max_delay_steps" in (
        capsys.readouterr().err
    )
    assert not out.exists()
