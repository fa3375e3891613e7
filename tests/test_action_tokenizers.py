"""Action tokenizers (`policies.action_tokenizers`): round-trip errors bounded by what the tokenizer
discards (half a bin; a coefficient's rounding through the orthonormal DCT), clipping counted, and every
token sequence a constrained decoder could emit decoded to a finite chunk of the fitted shape."""

import math

import numpy as np
import pytest

from policies.action_tokenizers import FASTTokenizer, UniformBinTokenizer, load_action_tokenizer

H, A = 16, 7


def smooth_chunks(n: int, seed: int = 0) -> np.ndarray:
    """(n, H, A) chunks like a robot's: each dimension a random low-frequency curve, dimensions of
    different scales (metres, radians, a gripper in [-1, 1])."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, H)[None, :, None]
    phase, freq = rng.uniform(0, 2 * np.pi, (n, 1, A)), rng.uniform(0.2, 1.5, (n, 1, A))
    scales = np.array([0.02, 0.02, 0.02, 0.1, 0.1, 0.1, 1.0])
    return scales * np.sin(2 * np.pi * freq * t + phase) + rng.normal(0, 0.1, (n, 1, A)) * scales


def test_binning_round_trip_is_within_half_a_bin_and_clipping_is_counted(tmp_path):
    chunks = smooth_chunks(200)
    tokenizer = UniformBinTokenizer.fit(chunks.tolist(), num_bins=256)  # nested lists are chunks too
    low, high = np.quantile(chunks.reshape(-1, A), 0.01, axis=0), np.quantile(chunks.reshape(-1, A), 0.99, axis=0)
    np.testing.assert_allclose(tokenizer.bin_width, (high - low) / 256)
    inside = np.clip(chunks[:50], low, high)
    tokens = tokenizer.encode(inside)
    assert all(len(t) == H * A for t in tokens.tokens) and (tokens.clipped == 0).all()
    back = tokenizer.decode(tokens.tokens)
    assert back.valid.all() and back.chunks.shape == (50, H, A)
    assert (np.abs(back.chunks - inside) <= (high - low) / 512 + 1e-12).all()  # half a bin per dimension
    # A value past the range is clipped into the last bin and counted.
    outside = inside[:2].copy()
    outside[0, 3, 6] = high[6] + 5.0
    result = tokenizer.encode(outside)
    assert result.clipped.tolist() == [1, 0] and result.tokens[0][3 * A + 6] == 255
    tokenizer.save(tmp_path)
    again = load_action_tokenizer(tmp_path)
    assert isinstance(again, UniformBinTokenizer) and again.encode(inside).tokens == tokens.tokens


def test_fast_round_trip_is_within_the_rounding_bound_and_smooth_chunks_compress(tmp_path):
    chunks = smooth_chunks(400)
    tokenizer = FASTTokenizer.fit(chunks[:300], scale=10.0, vocab_size=1024)
    low, high = tokenizer.low, tokenizer.high
    held_out = np.clip(chunks[300:], low, high)
    tokens = tokenizer.encode(held_out)
    back = tokenizer.decode(tokens.tokens)
    assert back.valid.all() and (tokens.clipped == 0).all()
    # Rounding error <= 1/(2 scale) per coefficient; the orthonormal inverse DCT keeps each dimension's L2
    # error over the 16 steps <= sqrt(16) / 20 = 0.2 in [-1, 1] units; times (high - low) / 2 in action units.
    bound = math.sqrt(H) / (2 * 10.0) * (high - low) / 2
    l2 = np.sqrt((((back.chunks - held_out) / ((high - low) / 2)) ** 2).sum(1))  # (B, A) in normalized units
    assert (l2 <= math.sqrt(H) / 20 + 1e-9).all()
    assert (np.abs(back.chunks - held_out) <= bound + 1e-9).all()
    mean_tokens = np.mean([len(t) for t in tokens.tokens])
    assert mean_tokens < H * A / 2, mean_tokens  # BPE over sparse coefficients: far fewer than 112 tokens
    tokenizer.save(tmp_path)
    again = load_action_tokenizer(tmp_path)
    assert isinstance(again, FASTTokenizer) and again.encode(held_out).tokens == tokens.tokens


@pytest.mark.parametrize("kind", ["bins", "fast"])
def test_every_sequence_a_decoder_can_emit_decodes_to_a_finite_chunk_of_the_fitted_shape(kind):
    chunks = smooth_chunks(100)
    tokenizer = UniformBinTokenizer.fit(chunks, 64) if kind == "bins" else FASTTokenizer.fit(chunks, vocab_size=512)
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, tokenizer.vocab_size, size=rng.integers(0, 3 * H * A)).tolist() for _ in range(200)]
    sequences += [[], [tokenizer.vocab_size + 5], [-1, 0]]  # empty, and ids no decoder may emit
    decoded = tokenizer.decode(sequences)
    assert decoded.chunks.shape == (len(sequences), H, A) and np.isfinite(decoded.chunks).all()
    assert not decoded.valid[-3:].any()  # malformed sequences are flagged, not refused
    well_formed = tokenizer.encode(chunks[:5]).tokens
    assert tokenizer.decode(well_formed).valid.all()


def test_a_tokenizer_refuses_chunks_of_other_dimensions_and_a_missing_one_names_the_fix(tmp_path):
    tokenizer = UniformBinTokenizer.fit(smooth_chunks(20))
    with pytest.raises(ValueError, match=r"fitted on chunks of 16 steps x 7 action dimensions, got \(2, 16, 6\)"):
        tokenizer.encode(np.zeros((2, H, 6)))
    with pytest.raises(ValueError, match="lacks its action tokenizer"):
        load_action_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="must hold the 81 coefficient values"):
        FASTTokenizer.fit(smooth_chunks(20), scale=10.0, vocab_size=50)  # 2 x ceil(10 x 4) + 1 values


@pytest.mark.parametrize("kind", ["uniform_bins", "fast"])
def test_fitted_on_a_recorded_dataset_the_round_trip_keeps_its_bound_and_the_tokenizer_travels(tiny_dataset, kind,
                                                                                                tmp_path):  # fmt: skip
    """Fitted on the lift demonstrations' chunks (`ChunkedDemos.action_chunks`, steps past an episode's end
    repeating its last action, as training sees them), saved beside the weights and loaded back."""
    import torch

    from policies.action_tokenizers import fit_action_tokenizer
    from vla_core.data import ChunkedDemos, open_dataset

    demos = ChunkedDemos(open_dataset(tiny_dataset[0]))
    chunks = demos.action_chunks(8).numpy()
    frame = int(demos.episode_end[0]) - 2  # two steps from the first episode's end
    expected = demos.action[[frame, frame + 1] + [frame + 1] * 6].numpy()
    np.testing.assert_array_equal(chunks[frame], expected)  # the last action repeated
    assert torch.equal(demos.action_chunks(8, torch.tensor([frame]))[0], torch.from_numpy(expected))
    tokenizer = fit_action_tokenizer(kind, chunks, **({"num_bins": 256} if kind == "uniform_bins" else {}))
    inside = np.clip(chunks, tokenizer.low, tokenizer.high)
    back = tokenizer.decode(tokenizer.encode(inside).tokens)
    bound = tokenizer.bin_width / 2 if kind == "uniform_bins" else tokenizer.max_error()
    assert back.valid.all() and (np.abs(back.chunks - inside) <= bound + 1e-9).all()
    tokenizer.save(tmp_path)
    again = load_action_tokenizer(tmp_path)
    assert again.encode(inside).tokens == tokenizer.encode(inside).tokens
    with pytest.raises(ValueError, match="unknown action tokenizer 'bpe'"):
        fit_action_tokenizer("bpe", chunks)


def test_the_relative_frame_is_steps_from_the_state_and_the_row_before_and_inverts_exactly():
    """Worked by hand: the arm at (0.10, 0.20, 0.30) (state entries 2..4, after two joints), a chunk of three
    rows; ee steps from the state, then from the row before; the grip (no state entry of its name) absolute."""
    import torch

    from policies.action_tokenizers.relative import delta_indices, from_delta, to_delta

    state_names = ["joint1", "joint2", "ee_x", "ee_y", "ee_z"]
    indices = delta_indices(state_names, ["ee_x", "ee_y", "ee_z", "grip"])
    assert indices == [2, 3, 4, -1]
    state = torch.tensor([[0.5, -0.5, 0.10, 0.20, 0.30]], dtype=torch.float64)
    chunk = torch.tensor([[[0.11, 0.20, 0.28, 0.0], [0.13, 0.19, 0.28, 1.0], [0.13, 0.19, 0.25, 1.0]]],
                         dtype=torch.float64)  # fmt: skip
    expected = torch.tensor([[[0.01, 0.00, -0.02, 0.0], [0.02, -0.01, 0.00, 1.0], [0.00, 0.00, -0.03, 1.0]]],
                            dtype=torch.float64)  # fmt: skip
    deltas = to_delta(chunk, state, indices)
    assert torch.allclose(deltas, expected, atol=1e-12)
    assert torch.allclose(from_delta(deltas, state, indices), chunk, atol=1e-12)
    with pytest.raises(ValueError, match="no action dimension"):
        delta_indices(state_names, ["dx", "grip"])
    with pytest.raises(ValueError, match="has no names"):
        delta_indices(None, ["ee_x"])
