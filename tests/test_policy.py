import pytest
import torch

from policies.diffusion import DiffusionConfig
from policies.diffusion.modeling_diffusion import DiffusionPolicy, SpatialSoftmax
from policies.tokenizer import word_vocabulary
from vla_core.types import ActionChunk, Policy


def make_policy(**kw):
    cfg = DiffusionConfig(state_dim=3, action_dim=2, cameras=["front"], image_size=32, horizon=4, n_action_steps=2,
                          vocabulary=word_vocabulary(["pick up the red cube"]), **kw)  # fmt: skip
    return DiffusionPolicy(cfg)


def obs(b=2, size=32):
    return {"observation.images.front": torch.rand(b, 3, size, size), "observation.state": torch.randn(b, 3),
            "task": ["pick up the red cube"] * b}  # fmt: skip


def test_predict_chunk_shapes_and_range():
    policy = make_policy()
    assert isinstance(policy, Policy)
    policy.set_normalization([0, 0, 0], [1, 1, 1], [0.2, -1.0], [0.4, 3.0])
    chunk = policy.predict_chunk(obs(), torch.tensor([3, 7]))
    assert isinstance(chunk, ActionChunk) and chunk.actions.shape == (2, 4, 2)
    assert chunk.obs_step.tolist() == [3, 7]
    # Outputs are un-normalized into the dataset's action range.
    assert (chunk.actions[..., 0] >= 0.2 - 1e-6).all() and (chunk.actions[..., 0] <= 0.4 + 1e-6).all()


def test_action_normalization_round_trip():
    policy = make_policy()
    policy.set_normalization([0, 0, 0], [1, 1, 1], [0.0, 2.0], [1.0, 2.0])  # second dim constant
    a = torch.tensor([[0.25, 2.0]])
    assert policy.normalize_action(a)[0, 0].item() == pytest.approx(-0.5)
    assert policy.normalize_action(a)[0, 1].item() == pytest.approx(0.0)  # constant dim maps to the centre
    torch.testing.assert_close(policy.unnormalize_action(policy.normalize_action(a)), a)


def test_spatial_softmax_finds_the_peak():
    ss = SpatialSoftmax(1, 1)
    with torch.no_grad():
        ss.proj.weight.fill_(50.0)
        ss.proj.bias.zero_()
    x = torch.zeros(1, 1, 9, 9)
    x[0, 0, 2, 6] = 1.0  # row 2 (y = -0.5), column 6 (x = 0.5) on a [-1, 1] grid
    y, xx = ss(x)[0].tolist()
    assert y == pytest.approx(-0.5, abs=1e-3) and xx == pytest.approx(0.5, abs=1e-3)


def test_bad_inputs_are_named():
    policy = make_policy()
    with pytest.raises(ValueError, match=r"must be \(2, 3, 32, 32\).*resize images to 32x32"):
        policy.predict_chunk(obs(size=48))
    bad = obs()
    bad["observation.state"][1, 0] = float("nan")
    with pytest.raises(ValueError, match="observation.state contains NaN"):
        policy.predict_chunk(bad)
    missing = obs()
    del missing["observation.images.front"]
    with pytest.raises(ValueError, match="missing observation.images.front"):
        policy.predict_chunk(missing)
    batch = {**obs(), "action": torch.full((2, 4, 2), float("nan")), "action_is_pad": torch.zeros(2, 4, dtype=bool)}
    with pytest.raises(ValueError, match="NaN or inf actions"):
        policy(batch)


def test_images_outside_zero_one_are_rejected_naming_the_fix():
    policy = make_policy()
    pixels = obs()
    pixels["observation.images.front"] = torch.tensor([0.0, 255.0]).repeat(2, 3, 32, 16)  # 0-255 values as float
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got values in \[0, 255\]; divide 0-255 .* by 255"):
        policy.predict_chunk(pixels)
    raw = obs()
    raw["observation.images.front"] = (raw["observation.images.front"] * 255).to(torch.uint8)
    fix = r"must be float in \[0, 1\], got torch.uint8; convert with img.float\(\) / 255"
    with pytest.raises(ValueError, match=fix):
        policy.predict_chunk(raw)
    normalized = obs()
    normalized["observation.images.front"][1, 0, 0, 0] = -0.5  # one pixel of a [-1, 1] normalized image
    with pytest.raises(ValueError, match=r"got values in \[-0.5, .*undo the normalization"):
        policy.predict_chunk(normalized)
    broken = obs()
    broken["observation.images.front"][0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="observation.images.front contains NaN or inf"):
        policy.predict_chunk(broken)
    edges = obs()
    edges["observation.images.front"] = torch.tensor([0.0, 1.0]).repeat(2, 3, 32, 16)  # both ends are valid
    assert policy.predict_chunk(edges).actions.shape == (2, 4, 2)


def test_padding_is_excluded_from_the_loss(monkeypatch):
    policy = make_policy()
    monkeypatch.setattr(policy, "denoise", lambda noisy, t, cond, known=None: torch.zeros_like(noisy))
    batch = {**obs(), "action": torch.zeros(2, 4, 2), "action_is_pad": torch.zeros(2, 4, dtype=bool)}
    batch["action_is_pad"][0, 2:] = True  # episode 0 ends after two steps
    loss = policy(batch, torch.Generator().manual_seed(0))
    noise = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(0))  # the first draw in forward()
    per_step = (noise**2).mean(-1)  # (2, 4) error of predicting zeros
    expected = (per_step[0, :2].sum() + per_step[1].sum()) / 6
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_unknown_words_map_to_unk():
    policy = make_policy()
    emb_known = policy._encode_text(["pick up the red cube"], "cpu")
    emb_unknown = policy._encode_text(["zzz qqq"], "cpu")
    unk = policy.word_embedding.weight[1]  # id 1 is <unk> in every vocabulary (policies.tokenizer)
    torch.testing.assert_close(emb_unknown[0], unk)
    assert not torch.allclose(emb_known[0], unk)
    # A known instruction is the mean of its words' embeddings, padding excluded.
    vocab = policy.config.vocabulary
    ids = [vocab.index(w) for w in ["pick", "up", "the", "red", "cube"]]
    torch.testing.assert_close(emb_known[0], policy.word_embedding.weight[ids].mean(0))


def test_given_noise_makes_a_chunk_reproducible_and_a_wrong_shape_is_named():
    policy = make_policy().eval()
    batch, noise = obs(), torch.randn(2, 4, 2)
    a = policy.predict_chunk(batch, noise=noise).actions
    torch.manual_seed(123)  # the global RNG must not matter when the noise is given
    b = policy.predict_chunk(batch, noise=noise.clone()).actions
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, policy.predict_chunk(batch, noise=torch.randn(2, 4, 2)).actions)
    with pytest.raises(ValueError, match=r"noise must be \(B, horizon, action_dim\) = \(2, 4, 2\)"):
        policy.predict_chunk(batch, noise=torch.randn(2, 5, 2))


@pytest.mark.parametrize(("bounds", "low", "high"), [
    ([], [0.2, -1.0], [0.4, 3.0]),  # no bounds: the demonstrations' range, as before the setting existed
    ([[0.0, -2.0], [1.0, 10.0]], [0.0, -2.0], [1.0, 10.0]),  # the given bounds, beyond what was demonstrated
])  # fmt: skip
def test_a_sampled_chunk_is_clamped_to_the_demonstrations_range_or_to_the_given_bounds(bounds, low, high):
    policy = make_policy(objective="flow", action_bounds=bounds)
    policy.set_normalization([0, 0, 0], [1, 1, 1], [0.2, -1.0], [0.4, 3.0])
    policy.denoise = lambda x, t, cond, known=None: torch.zeros_like(x)  # no velocity: the chunk is its start
    start = torch.tensor([50.0, -50.0, 0.0, 50.0]).view(1, 4, 1).expand(2, 4, 2)
    chunk = policy.predict_chunk(obs(), torch.tensor([0, 0]), noise=start).actions
    middle = [(lo + hi) / 2 for lo, hi in zip([0.2, -1.0], [0.4, 3.0])]  # normalized 0: the demonstrations' centre
    expected = torch.tensor([high, low, middle, high]).expand(2, 4, 2)
    torch.testing.assert_close(chunk, expected)


def test_action_bounds_are_checked_against_the_actions():
    with pytest.raises(ValueError, match="action_bounds"):
        DiffusionConfig(action_bounds=[[0.0, 1.0], [-1.0, 2.0]]).validate()  # low > high in the first action
    with pytest.raises(ValueError, match="3 values per bound; the actions have 2"):
        make_policy(objective="flow", action_bounds=[[0.0] * 3, [1.0] * 3])
    # ddpm's sampler clips its clean estimate to the demonstrations' range at every step: bounds would do nothing
    with pytest.raises(ValueError, match="needs --policy.objective=flow"):
        DiffusionConfig(action_bounds=[[0.0, 0.0], [1.0, 1.0]]).validate()
