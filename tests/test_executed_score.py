"""Scoring only what runs keeps the policy gradient unbiased and lowers its variance: brute force on toys.

The estimator is REINFORCE's, R * grad log pi(decision), with the score the RL actors return: every factor
of a denoising chain but the final step's rows that did not run; every token of a sequence up to the last
executed row. Each toy's exact gradient of E[R] is worked out apart from the code under test (in closed
form for the Gaussian chain, by enumerating every outcome for the tokens), and the estimator's mean over
200,000 draws must be within 3 standard errors of it, with and without the rows that did not run.
"""

from types import SimpleNamespace

import torch

from policies.denoising_chain import DenoisingChain
from policies.token_actor import TokenActor, TokenDecision

DRAWS = 200_000


def _within_three_standard_errors(samples: torch.Tensor, exact: torch.Tensor) -> None:
    """samples (N, P) per-draw gradient estimates; exact (P,)."""
    mean, standard_error = samples.mean(0), samples.std(0) / samples.shape[0] ** 0.5
    assert ((mean - exact).abs() <= 3 * standard_error + 1e-9).all(), (mean, exact, standard_error)


def test_a_chain_scored_on_its_executed_rows_gives_the_exact_gradient_with_less_variance():
    """Two Euler-like steps over a chunk of 3 rows (1 action dim), both steps' means sharing the weights b:

        x1 = b + W0 x0 + s z1,    x2 = W1 x1 + b + s z2,    x0, z1, z2 ~ N(0, I)

    W0 and W1 mix the rows, so row 2 of x1 moves every row of x2. Rows 0 and 1 of the chunk ran; the reward
    reads them only: R = -(x2[0] - 1)^2 + x2[1]. x2 is Gaussian with mean mu = (W1 + I) b and a covariance
    free of b, so grad_b E[R] = (W1 + I)^T (-2 (mu_0 - 1), 1, 0)."""
    g = torch.Generator().manual_seed(0)
    h, s = 3, 0.5
    w0 = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, -0.4], [0.3, -0.2, 0.7]], dtype=torch.float64)
    w1 = torch.tensor([[0.8, 0.1, 0.5], [-0.3, 0.9, 0.4], [0.2, 0.3, 0.6]], dtype=torch.float64)
    b0 = torch.tensor([0.3, -0.2, 0.4], dtype=torch.float64)
    mu = (w1 + torch.eye(h, dtype=torch.float64)) @ b0
    exact = (w1 + torch.eye(h, dtype=torch.float64)).T @ torch.tensor([-2 * (mu[0] - 1), 1.0, 0.0], dtype=torch.float64)

    x0 = torch.randn(DRAWS, h, generator=g, dtype=torch.float64)
    x1 = b0 + x0 @ w0.T + s * torch.randn(DRAWS, h, generator=g, dtype=torch.float64)
    x2 = x1 @ w1.T + b0 + s * torch.randn(DRAWS, h, generator=g, dtype=torch.float64)
    reward = -((x2[:, 0] - 1) ** 2) + x2[:, 1]
    latents = torch.stack([x0, x1, x2], 1)[..., None]  # (N, K + 1, H, A)
    executed = torch.tensor([True, True, False]).expand(DRAWS, h)

    def estimates(chain: DenoisingChain) -> torch.Tensor:
        b = b0.expand(DRAWS, h).clone().requires_grad_()  # one copy of b per draw: its gradient is per draw
        means = torch.stack([b + x0 @ w0.T, x1 @ w1.T + b], 1)[..., None]  # (N, K, H, A)
        chain.step_log_prob(means).sum().backward()
        return reward[:, None] * b.grad

    chain = DenoisingChain(latents, torch.full((2,), s, dtype=torch.float64))
    every_row, ran = estimates(chain), estimates(chain.with_executed(executed))
    _within_three_standard_errors(every_row, exact)
    _within_three_standard_errors(ran, exact)
    # Only the final step's row 2 left the score: b's other components are estimated exactly as before, and the
    # one it fed loses the noise it added.
    torch.testing.assert_close(ran[:, :2], every_row[:, :2])
    assert ran[:, 2].var() < 0.8 * every_row[:, 2].var()
    # The test has teeth: leaving row 2 out of every step (its step-0 sample feeds the rows that ran) is biased.
    every_step = estimates(
        DenoisingChain(latents, chain.std, known=torch.tensor([False, False, True]).expand(DRAWS, h))
    )
    assert (every_step.mean(0) - exact).abs()[2] > 10 * every_step[:, 2].std() / DRAWS**0.5


def test_tokens_after_the_last_executed_row_leave_the_score_and_the_gradient_stays_exact():
    """Uniform-bin tokens of a 2-row chunk (1 action dim): token 0 writes row 0, token 1 row 1, each one of 3
    bins: p(y0) = softmax(a), p(y1 | y0) = softmax(B[y0]). Only row 0 ran and R = r[y0]. The exact gradient
    enumerates the 9 outcomes: grad_a E[R] = sum p(y0) r[y0] (e_{y0} - p), grad_B E[R] = 0."""
    g = torch.Generator().manual_seed(1)
    a = torch.tensor([0.2, -0.5, 0.4], dtype=torch.float64)
    bmat = torch.tensor([[0.3, 0.1, -0.2], [-0.4, 0.6, 0.0], [0.5, -0.1, 0.2]], dtype=torch.float64)
    r = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)

    params = [a.clone().requires_grad_(), bmat.clone().requires_grad_()]
    p0 = params[0].softmax(0)
    expected_reward = sum(p0[i] * params[1][i].softmax(0)[j] * r[i] for i in range(3) for j in range(3))
    exact = torch.cat([x.flatten() for x in torch.autograd.grad(expected_reward, params)])

    y0 = torch.multinomial(a.softmax(0), DRAWS, replacement=True, generator=g)
    y1 = torch.multinomial(bmat.softmax(1)[y0], 1, generator=g)[:, 0]
    decision = TokenDecision(torch.stack([y0, y1], 1), torch.ones(DRAWS, 2, dtype=torch.bool))
    rows = SimpleNamespace(token_budget=2, device=torch.device("cpu"),
                           token_rows=lambda width: torch.arange(width))  # fmt: skip
    actor = TokenActor(rows, temperature=1.0)
    executed = torch.tensor([True, False]).expand(DRAWS, 2)

    def estimates(scored: torch.Tensor) -> torch.Tensor:
        a_ = a.expand(DRAWS, 3).clone().requires_grad_()
        b_ = bmat.expand(DRAWS, 3, 3).clone().requires_grad_()
        log_p = torch.stack([a_.log_softmax(1).gather(1, y0[:, None])[:, 0],
                             b_[torch.arange(DRAWS), y0].log_softmax(1).gather(1, y1[:, None])[:, 0]], 1)  # fmt: skip
        torch.where(scored, log_p, 0.0).sum().backward()
        return r[y0][:, None] * torch.cat([a_.grad, b_.grad.flatten(1)], 1)

    every_token, ran = (
        estimates(actor.scored_tokens(decision, None)),
        estimates(actor.scored_tokens(decision, executed)),
    )
    assert actor.scored_tokens(decision, executed)[0].tolist() == [True, False]
    _within_three_standard_errors(every_token, exact)
    _within_three_standard_errors(ran, exact)
    assert (ran[:, 3:] == 0).all() and every_token[:, 3:].var(0).sum() > 0  # B's true gradient is 0
    torch.testing.assert_close(ran[:, :3], every_token[:, :3])


def test_fast_tokens_span_the_chunk_and_all_stay():
    """A tokenizer whose tokens do not map to rows (FAST: DCT coefficients) keeps every written token."""
    policy = SimpleNamespace(token_budget=4, device=torch.device("cpu"), token_rows=lambda width: None)
    decision = TokenDecision(torch.zeros(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool())
    executed = torch.tensor([[True, False], [False, True]])
    assert torch.equal(TokenActor(policy, 1.0).scored_tokens(decision, executed), decision.mask)


def test_uniform_bin_tokens_are_scored_up_to_the_last_executed_row():
    """A = 2 dims: tokens 2j, 2j + 1 write row j. Rows 1-2 ran in the first chunk (tokens 0-5 stay: 0-1 feed
    the rest), row 0 only in the second (tokens 0-1)."""
    policy = SimpleNamespace(
        token_budget=8, device=torch.device("cpu"), token_rows=lambda width: torch.arange(width) // 2
    )
    decision = TokenDecision(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool))
    executed = torch.tensor([[False, True, True, False], [True, False, False, False]])
    scored = TokenActor(policy, 1.0).scored_tokens(decision, executed)
    assert scored.int().tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]


def test_the_final_step_leaves_out_unexecuted_rows_and_padded_dims_and_nothing_else():
    """By hand, std 1, every latent 1 and every mean 0: each element's log-density is -1/2 - log(2 pi)/2. A
    chunk of 4 rows x 3 dims whose first 2 dims run (a padded sampler), rows 1-2 ran, row 0 committed:
    step 0 covers rows 1-3 x 3 dims (9 elements), the final step rows 1-2 x 2 dims (4)."""
    import math

    chain = DenoisingChain(torch.ones(1, 3, 4, 3), torch.ones(2), known=torch.tensor([[True, False, False, False]]))
    scored = chain.with_executed(torch.tensor([[True, True, True]]), dims=2)  # rows past 3 never run
    scored = scored.with_executed(torch.tensor([[False, True, True, False]]), dims=2)
    element = -0.5 - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(
        scored.step_log_prob(torch.zeros(1, 2, 4, 3)), torch.tensor([[9 * element, 4 * element]])
    )
    torch.testing.assert_close(chain.step_log_prob(torch.zeros(1, 2, 4, 3)), torch.tensor([[9 * element, 9 * element]]))
