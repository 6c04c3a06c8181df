#!/usr/bin/env python3
"""Golden numbers for the RL objectives (issue 15, must-show 1).

Each objective is written here straight from its published formula, on the
response tokens only (the tokens are picked out with the mask first, so what
padding holds never enters; the C++ side instead masks in place), in float64,
and differentiated by torch.autograd:

  GRPO  Shao et al. 2024 (DeepSeekMath), token-level clipped surrogate with
        group-normalized advantages; the KL term is verl's low_var_kl (k3);
        DAPO's clip-higher (Yu et al. 2025), Dr. GRPO's unscaled advantages
        and constant normaliser (Liu et al. 2025), TRL's batch-std scaling
  GSPO  Zheng et al. 2025, sequence ratio s_i = exp(mean_t log r_it), clipped
        per sequence, J = mean_i -min(s_i A_i, clip(s_i) A_i)
  DPO   Rafailov et al. 2023, -log sigmoid(beta ((pc - rc) - (pr - rr))), and
        TRL's variants of z = (pc - pr) - (rc - rr): label smoothing (cDPO),
        robust (Chowdhury et al. 2024), hinge (SLiC), IPO (Azar et al. 2023,
        (z - 1/(2 beta))^2 on length-averaged log-probabilities)
  PPO   Schulman et al. 2017 (clipped surrogate, GAE in closed form
        A_t = sum_l (gamma lam)^l delta_{t+l}), dual clip (Ye et al. 2020),
        clipped value loss and low_var_kl as verl
  KL in the reward  verl's apply_kl_penalty (kl / abs / mse / low_var_kl
        estimators, beta times the penalty off each token's reward, the
        penalty's mean per sequence then over sequences) and its adaptive
        controller (Ziegler et al. 2019)

Writes tests/data/rl/rl_golden.safetensors (float64): the inputs, each loss,
its statistics and its gradients. Deterministic: the same file on every run.
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)
NAN = float("nan")


# ---------------------------------------------------------------- helpers

def mask_from_lengths(lens, T, holes=()):
    """[N, T] 0/1 with the first lens[i] tokens of row i on, minus (i, t) in holes."""
    m = torch.zeros(len(lens), T)
    for i, n in enumerate(lens):
        m[i, :n] = 1
    for i, t in holes:
        m[i, t] = 0
    return m


def fill_masked(x, mask, values):
    """x with the mask-0 positions set to `values`, cycled (NaN, inf, huge)."""
    x = x.clone()
    off = (mask == 0).nonzero().tolist()
    for k, (i, t) in enumerate(off):
        x[i, t] = values[k % len(values)]
    return x


def exact_log_ratio(target_ratio, rng):
    """(logp, old) with logp - old == d in float64 and exp(d) == target_ratio
    bit for bit (torch and libm), so that the ratio sits exactly on a clip bound."""
    d0 = math.log(target_ratio)
    for _ in range(1000):
        logp = -float(torch.rand((), generator=rng)) * 2 - 0.1
        old = logp - d0
        d = logp - old
        if math.exp(d) == target_ratio and torch.exp(torch.tensor(d)).item() == target_ratio:
            return logp, old
    raise SystemExit(f"no exact log-ratio found for {target_ratio}")


def set_log_ratio(logp, old, i, t, d):
    old[i, t] = logp[i, t] - d


def k3(logp, ref):
    """verl's low_var_kl: d = clamp(ref - logp, -20, 20); clamp(e^d - d - 1, -10, 10)."""
    d = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(d) - d - 1, -10, 10)


def seq_ids(mask):
    N, T = mask.shape
    return torch.arange(N).unsqueeze(1).expand(N, T)[mask.bool()]


def seq_mean_token_mean(tok, ids, N):
    """1/|S| sum_{i in S} 1/|o_i| sum_t tok, over sequences S with tokens."""
    per = [tok[ids == i].mean() for i in range(N) if (ids == i).any()]
    return torch.stack(per).mean()


def scalars(out, prefix, d):
    for k, v in d.items():
        out[f"{prefix}.{k}"] = torch.as_tensor(v, dtype=torch.float64).reshape(())


# ---------------------------------------------------------------- GRPO

def grpo_advantages(rewards, G, eps=1e-6, scale="group"):
    r = rewards.view(-1, G)
    centred = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = centred / (r.std(1, keepdim=True) + eps)  # torch.std: unbiased
    elif scale == "batch":
        adv = centred / (rewards.std() + eps)
    else:
        adv = centred
    equal = r.max(1, keepdim=True).values == r.min(1, keepdim=True).values
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1)


def grpo_reference(logp, old, adv_seq, mask, eps, agg, kl_coef, ref, eps_high=None, norm_length=None):
    logp = logp.clone().requires_grad_()
    m = mask.bool()
    lp, ol = logp[m], old[m]
    A = adv_seq.unsqueeze(1).expand_as(mask)[m]
    ids = seq_ids(mask)
    ratio = torch.exp(torch.clamp(lp - ol, -20, 20))
    hi = eps if eps_high is None else eps_high
    unclipped, clipped = ratio * A, torch.clamp(ratio, 1 - eps, 1 + hi) * A
    tok = -torch.min(unclipped, clipped)
    if agg == "token_mean":
        reduce = lambda x: x.mean()
    elif agg == "seq_mean_token_mean":
        reduce = lambda x: seq_mean_token_mean(x, ids, mask.shape[0])
    else:  # Dr. GRPO / TRL "dr_grpo": sum over tokens / (N * L)
        reduce = lambda x: x.sum() / (mask.shape[0] * norm_length)
    pg = reduce(tok)
    loss = pg
    stats = {}
    if kl_coef > 0:
        kl = reduce(k3(lp, ref[m]))
        loss = pg + kl_coef * kl
        stats["kl_loss"] = kl.item()
    loss.backward()
    stats.update(loss=loss.item(), pg_loss=pg.item(), ratio_mean=ratio.mean().item(),
                 clip_frac=(clipped < unclipped).double().mean().item(), kl=(ol - lp).mean().item(),
                 advantage_mean=A.mean().item())
    return stats, logp.grad


def make_grpo(rng, out):
    N, G, T, eps = 12, 4, 6, 0.2
    # Lengths differ; row 0 has a masked tool result at t = 2; row 11 is empty.
    mask = mask_from_lengths([6, 4, 5, 3, 6, 2, 6, 1, 5, 4, 3, 0], T, holes=[(0, 2)])
    # Group 1 (rows 4-7) has equal rewards: advantages 0, no gradient.
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 1.0, 0.0])
    adv = grpo_advantages(rewards, G)
    assert (adv[4:8] == 0).all() and adv[0] > 0 and adv[1] < 0
    logp = -torch.rand(N, T, generator=rng) * 2.9 - 0.05
    old = logp - torch.randn(N, T, generator=rng) * 0.2
    at_edge = torch.zeros(N, T)
    # Row 0 (A > 0): exactly at 1 + eps, beyond it, below 1 - eps (not clipped for A > 0).
    logp[0, 0], old[0, 0] = exact_log_ratio(1 + eps, rng)
    at_edge[0, 0] = 1
    set_log_ratio(logp, old, 0, 1, 0.3)
    set_log_ratio(logp, old, 0, 3, -0.4)
    # Row 1 (A < 0): exactly at 1 - eps, below it, above 1 + eps (not clipped for A < 0).
    logp[1, 0], old[1, 0] = exact_log_ratio(1 - eps, rng)
    at_edge[1, 0] = 1
    set_log_ratio(logp, old, 1, 1, -0.5)
    set_log_ratio(logp, old, 1, 2, 0.35)
    # Row 8 (A < 0) exactly at 1 + eps: inside for a negative advantage.
    logp[8, 1], old[8, 1] = exact_log_ratio(1 + eps, rng)
    at_edge[8, 1] = 1
    ref = logp + torch.randn(N, T, generator=rng) * 0.3
    logp = fill_masked(logp, mask, [NAN, 30.0, -1e4, math.inf])
    old = fill_masked(old, mask, [-1e4, NAN])
    ref = fill_masked(ref, mask, [NAN])
    out.update({"grpo.logp": logp, "grpo.old_logp": old, "grpo.ref_logp": ref, "grpo.mask": mask,
                "grpo.rewards": rewards, "grpo.advantages": adv, "grpo.at_edge": at_edge})
    scalars(out, "grpo", {"group_size": G, "clip_eps": eps, "kl_coef": 0.04})
    for agg, kl_coef in [("token_mean", 0.04), ("seq_mean_token_mean", 0.0)]:
        stats, grad = grpo_reference(logp, old, adv, mask, eps, agg, kl_coef, ref)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
        assert kl_coef > 0 or (grad[4:8] == 0).all()  # equal rewards: no policy gradient
        out[f"grpo.{agg}.grad_logp"] = grad
        scalars(out, f"grpo.{agg}", stats)
    # DAPO's clip-higher (0.2 below, 0.28 above: row 0's token at exactly 1.2 is inside) with
    # Dr. GRPO's sum / (N * L), L = 8 > T; and the advantages scaled by the batch std or not at all.
    stats, grad = grpo_reference(logp, old, adv, mask, eps, "sum_norm", 0.0, ref, eps_high=0.28, norm_length=8)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    out["grpo.dapo.grad_logp"] = grad
    scalars(out, "grpo.dapo", dict(stats, eps_high=0.28, norm_length=8))
    for scale in ["batch", "none"]:
        out[f"grpo.advantages_{scale}"] = grpo_advantages(rewards, G, scale=scale)


# ------------------------------------------- outcome advantage estimators (verl)

def verl_group_mean(scores, index):
    # verl's id2mean: the mean of each index's scores, 0 for an index with one score.
    means = torch.zeros_like(scores)
    for g in set(index):
        members = [i for i in range(len(index)) if index[i] == g]
        means[members] = 0.0 if len(members) == 1 else scores[members].mean()
    return means


def verl_equal(scores, index):
    # Members of a group (of more than one) whose scores are all equal: areno gives them exactly 0.
    eq = torch.zeros(len(index), dtype=torch.bool)
    for g in set(index):
        members = [i for i in range(len(index)) if index[i] == g]
        eq[members] = len(members) > 1 and bool(scores[members].max() == scores[members].min())
    return eq


def verl_rloo(scores, index):
    # verl compute_rloo_outcome_advantage: s * n / (n - 1) - mean * n / (n - 1) where n > 1.
    means = verl_group_mean(scores, index)
    out = scores.clone()
    for i in range(len(index)):
        n = index.count(index[i])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - means[i] * n / (n - 1)
    return torch.where(verl_equal(scores, index), torch.zeros_like(out), out)


def verl_reinforce_pp(scores, mask):
    # gamma 1: every response token's return is the score; verl_F.masked_whiten over the batch's tokens.
    w = whiten(scores.unsqueeze(1).expand_as(mask).clone(), mask)
    return torch.stack([w[i][mask[i].bool()][0] if mask[i].any() else torch.tensor(0.0, dtype=w.dtype)
                        for i in range(mask.shape[0])])


def verl_reinforce_pp_baseline(scores, index, mask):
    centred = scores - verl_group_mean(scores, index)
    centred = torch.where(verl_equal(scores, index), torch.zeros_like(centred), centred)
    return verl_reinforce_pp(centred, mask)


def make_adv_estimators(out):
    # The GRPO case's rewards (groups of 4, group 1 all 0.7) and trainable tokens per row, and a
    # ragged case (groups of 3, 1, 2: a lone sample keeps its score in verl).
    mask = out["grpo.mask"]
    rewards = out["grpo.rewards"]
    index = [i // 4 for i in range(12)]
    cases = {"even": (rewards, index, mask)}
    r2 = torch.tensor([1.0, 2.0, 4.0, 9.0, 3.0, 5.0], dtype=torch.float64)
    m2 = mask_from_lengths([2, 3, 1, 4, 2, 2], 4)
    cases["ragged"] = (r2, [0, 0, 0, 1, 2, 2], m2)
    for name, (r, idx, m) in cases.items():
        out[f"adv.{name}.rewards"] = r.clone()
        out[f"adv.{name}.tokens"] = m.sum(1)
        out[f"adv.{name}.group_sizes"] = torch.tensor([idx.count(g) for g in sorted(set(idx))], dtype=torch.float64)
        out[f"adv.{name}.rloo"] = verl_rloo(r, idx)
        out[f"adv.{name}.reinforce_plus_plus"] = verl_reinforce_pp(r, m)
        out[f"adv.{name}.reinforce_plus_plus_baseline"] = verl_reinforce_pp_baseline(r, idx, m)


# ---------------------------------------------------------------- GSPO

def gspo_reference(logp, old, adv, mask, eps):
    logp = logp.clone().requires_grad_()
    terms, ratios, clipped_seqs = [], [], []
    for i in range(mask.shape[0]):
        m = mask[i].bool()
        if not m.any():
            continue
        s = torch.exp(torch.clamp((logp[i][m] - old[i][m]).mean(), -20, 20))
        unclipped, clipped = s * adv[i], torch.clamp(s, 1 - eps, 1 + eps) * adv[i]
        terms.append(-torch.min(unclipped, clipped))
        ratios.append(s.item())
        clipped_seqs.append(float(clipped < unclipped))
    loss = torch.stack(terms).mean()
    loss.backward()
    m = mask.bool()
    A = adv.unsqueeze(1).expand_as(mask)[m]
    stats = {"loss": loss.item(), "pg_loss": loss.item(), "ratio_mean": sum(ratios) / len(ratios),
             "clip_frac": sum(clipped_seqs) / len(clipped_seqs), "kl": (old[m] - logp[m]).mean().item(),
             "advantage_mean": A.mean().item()}
    return stats, logp.grad


def make_gspo(rng, out):
    N, T, eps = 6, 5, 3e-4
    mask = mask_from_lengths([1, 5, 3, 4, 2, 5], T, holes=[(3, 1)])
    adv = torch.tensor([1.0, -0.8, 0.5, -1.2, 0.0, 0.9])
    # Sequence log-ratios: row 0 exactly at 1 + eps (one token); row 1 (A < 0)
    # below 1 - eps; row 2 inside; row 3 (A < 0) above 1 + eps, not clipped;
    # row 5 (A > 0) above, clipped. The token ratios spread far wider.
    target = [None, -1e-3, 1e-4, 5e-4, -2e-4, 2e-3]
    logp = -torch.rand(N, T, generator=rng) * 2.0 - 0.1
    old = logp.clone()
    for i in range(1, N):
        m = mask[i].bool()
        noise = torch.randn(int(m.sum()), generator=rng) * 0.05
        old[i, m] = logp[i, m] - (target[i] + noise - noise.mean())
    logp[0, 0], old[0, 0] = exact_log_ratio(1 + eps, rng)
    logp = fill_masked(logp, mask, [NAN, 25.0, -math.inf])
    old = fill_masked(old, mask, [NAN, -1e4])
    out.update({"gspo.logp": logp, "gspo.old_logp": old, "gspo.mask": mask, "gspo.advantages": adv})
    scalars(out, "gspo", {"clip_eps": eps})
    stats, grad = gspo_reference(logp, old, adv, mask, eps)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    assert stats["clip_frac"] == 2 / 6, stats
    out["gspo.grad_logp"] = grad
    scalars(out, "gspo", stats)


# ---------------------------------------------------------------- DPO

def dpo_reference(lc, mc, lr, mr, ref_c, ref_r, beta):
    lc, lr = lc.clone().requires_grad_(), lr.clone().requires_grad_()
    pc = torch.stack([lc[i][mc[i].bool()].sum() for i in range(lc.shape[0])])
    pr = torch.stack([lr[i][mr[i].bool()].sum() for i in range(lr.shape[0])])
    chosen, rejected = beta * (pc - ref_c), beta * (pr - ref_r)
    z = beta * ((pc - ref_c) - (pr - ref_r))
    loss = -F.logsigmoid(z).mean()
    loss.backward()
    stats = {"loss": loss.item(), "chosen_reward": chosen.mean().item(), "rejected_reward": rejected.mean().item(),
             "reward_margin": (chosen - rejected).mean().item(), "reward_accuracy": (z > 0).double().mean().item()}
    return stats, lc.grad, lr.grad


def dpo_variant(lc, mc, lr, mr, ref_c, ref_r, beta, kind, ls):
    """TRL's DPOTrainer.dpo_loss for loss_type `kind`; IPO averages the log-probabilities over each response."""
    lc, lr = lc.clone().requires_grad_(), lr.clone().requires_grad_()
    pc = torch.stack([lc[i][mc[i].bool()].sum() for i in range(lc.shape[0])])
    pr = torch.stack([lr[i][mr[i].bool()].sum() for i in range(lr.shape[0])])
    rc, rr = ref_c, ref_r
    if kind == "ipo":
        pc, pr, rc, rr = pc / mc.sum(1), pr / mr.sum(1), rc / mc.sum(1), rr / mr.sum(1)
    z = (pc - pr) - (rc - rr)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
    elif kind == "robust":
        losses = (-F.logsigmoid(beta * z) * (1 - ls) + F.logsigmoid(-beta * z) * ls) / (1 - 2 * ls)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * z)
    else:
        losses = (z - 1 / (2 * beta)) ** 2
    loss = losses.mean()
    loss.backward()
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    stats = {"loss": loss.item(), "chosen_reward": chosen.mean().item(), "rejected_reward": rejected.mean().item(),
             "reward_margin": (chosen - rejected).mean().item(),
             "reward_accuracy": (chosen > rejected).double().mean().item()}
    return stats, lc.grad, lr.grad


def make_dpo(rng, out):
    B, T, beta = 5, 5, 0.1
    mc = mask_from_lengths([5, 3, 4, 2, 5], T, holes=[(0, 1)])
    mr = mask_from_lengths([4, 5, 2, 3, 1], T)
    lc = -torch.rand(B, T, generator=rng) * 2.4 - 0.1
    lr = -torch.rand(B, T, generator=rng) * 2.4 - 0.1
    ref_c = (lc * mc).sum(1) + torch.randn(B, generator=rng) * 0.8
    ref_r = (lr * mr).sum(1) + torch.randn(B, generator=rng) * 0.8
    ref_c[3] += 300.0  # z near -30: the loss is ~30, its gradient ~ -beta
    ref_r[4] += 400.0  # z near +40: loss ~ 4e-18, no overflow either way
    lc = fill_masked(lc, mc, [NAN, 40.0])
    lr = fill_masked(lr, mr, [-math.inf, NAN])
    out.update({"dpo.chosen_logp": lc, "dpo.chosen_mask": mc, "dpo.rejected_logp": lr, "dpo.rejected_mask": mr,
                "dpo.ref_chosen": ref_c, "dpo.ref_rejected": ref_r})
    scalars(out, "dpo", {"beta": beta})
    stats, gc, gr = dpo_reference(lc, mc, lr, mr, ref_c, ref_r, beta)
    assert torch.isfinite(gc).all() and torch.isfinite(gr).all()
    out["dpo.grad_chosen_logp"], out["dpo.grad_rejected_logp"] = gc, gr
    scalars(out, "dpo", stats)
    # The variants on the same pairs; hinge with beta 0.5 so that some pairs sit past the hinge.
    for kind, b, ls in [("sigmoid", beta, 0.1), ("robust", beta, 0.1), ("hinge", 0.5, 0.0), ("ipo", beta, 0.0)]:
        stats, gc, gr = dpo_variant(lc, mc, lr, mr, ref_c, ref_r, b, kind, ls)
        assert torch.isfinite(gc).all() and torch.isfinite(gr).all()
        if kind == "hinge":
            assert (gc.abs().sum(1) == 0).any() and (gc.abs().sum(1) > 0).any()
        out[f"dpo.{kind}.grad_chosen_logp"], out[f"dpo.{kind}.grad_rejected_logp"] = gc, gr
        scalars(out, f"dpo.{kind}", dict(stats, beta=b, label_smoothing=ls))


# ---------------------------------------------------------------- PPO

def gae_reference(rewards, values, mask, gamma, lam):
    """Closed form on each row's response tokens (mask-0 positions skipped):
    A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V past the end = 0."""
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    for i in range(values.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        v = [values[i, t].item() for t in idx] + [0.0]
        delta = [rewards[i, t].item() + gamma * v[k + 1] - v[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):
            a = sum((gamma * lam) ** l * delta[k + l] for l in range(len(idx) - k))
            adv[i, t], ret[i, t] = a, a + v[k]
    return adv, ret


def whiten(adv, mask):
    m = mask.bool()
    a = adv[m]
    w = torch.zeros_like(adv)
    w[m] = (a - a.mean()) / torch.sqrt(a.var() + 1e-8)  # unbiased var, mean not added back
    return w


def ppo_reference(logp, old, adv, mask, values, old_values, returns, ref, o):
    logp, values = logp.clone().requires_grad_(), values.clone().requires_grad_()
    m = mask.bool()
    lp, ol, A = logp[m], old[m], adv[m]
    ratio = torch.exp(torch.clamp(lp - ol, -20, 20))
    l1, l2 = -A * ratio, -A * torch.clamp(ratio, 1 - o["clip_eps"], 1 + o["clip_eps"])
    l = torch.max(l1, l2)
    l3 = -A * o["clip_ratio_c"]
    pg = torch.where(A < 0, torch.min(l, l3), l).mean()
    kl = k3(lp, ref[m]).mean()
    v, vo, R = values[m], old_values[m], returns[m]
    v_clipped = torch.max(torch.min(v, vo + o["value_clip_eps"]), vo - o["value_clip_eps"])
    e1, e2 = (v - R) ** 2, (v_clipped - R) ** 2
    vf = 0.5 * torch.max(e1, e2).mean()
    loss = pg + o["kl_loss_coef"] * kl + o["value_loss_coef"] * vf
    loss.backward()
    stats = {"loss": loss.item(), "pg_loss": pg.item(), "kl_loss": kl.item(), "vf_loss": vf.item(),
             "ratio_mean": ratio.mean().item(), "clip_frac": (l2 > l1).double().mean().item(),
             "clip_frac_lower": ((l > l3) & (A < 0)).double().mean().item(), "kl": (ol - lp).mean().item(),
             "advantage_mean": A.mean().item(), "vf_clip_frac": (e2 > e1).double().mean().item(),
             "value_mean": v.mean().item(), "return_mean": R.mean().item()}
    return stats, logp.grad, values.grad


def make_ppo(rng, out):
    N, T = 4, 7
    gamma, lam = 0.99, 0.95
    o = {"clip_eps": 0.2, "clip_ratio_c": 3.0, "value_clip_eps": 0.2, "value_loss_coef": 0.5, "kl_loss_coef": 0.1}
    mask = mask_from_lengths([7, 5, 6, 3], T, holes=[(0, 3), (2, 1)])
    # GAE: per-token rewards (a small penalty) plus an outcome reward on the last token.
    rewards = torch.randn(N, T, generator=rng) * 0.05
    for i in range(N):
        rewards[i, int(mask[i].nonzero().max())] += [1.0, -0.5, 0.0, 2.0][i]
    old_values = torch.randn(N, T, generator=rng) * 0.5
    adv_raw, returns = gae_reference(rewards, old_values, mask, gamma, lam)
    adv_white = whiten(adv_raw, mask)
    # The loss takes designed advantages so that every branch occurs.
    adv = torch.randn(N, T, generator=rng)
    logp = -torch.rand(N, T, generator=rng) * 2.5 - 0.05
    old = logp - torch.randn(N, T, generator=rng) * 0.15
    cases = [  # (i, t, A, log ratio)
        (0, 0, -1.0, math.log(3.5)),  # A < 0, ratio beyond clip_ratio_c: dual clip holds the loss at 3|A|
        (0, 1, -0.7, math.log(2.0)),  # A < 0, 1 + eps < ratio < c: unclipped
        (0, 2, 0.8, 0.5),             # A > 0, above 1 + eps: clipped
        (1, 0, -0.6, -0.5),           # A < 0, below 1 - eps: clipped
        (1, 1, 0.9, -0.6),            # A > 0, below 1 - eps: unclipped
    ]
    for i, t, a, d in cases:
        adv[i, t] = a
        set_log_ratio(logp, old, i, t, d)
    values = old_values + torch.randn(N, T, generator=rng) * 0.4
    ref = logp + torch.randn(N, T, generator=rng) * 0.3
    ref[2, 0] = logp[2, 0] + 3.0  # e^3 - 4 > 10: the k3 clamp, no KL gradient there
    logp = fill_masked(logp, mask, [NAN, 12.0])
    old = fill_masked(old, mask, [-1e4])
    ref = fill_masked(ref, mask, [NAN])
    values = fill_masked(values, mask, [NAN, 1e6])
    adv = fill_masked(adv, mask, [NAN])
    out.update({"ppo.token_rewards": rewards, "ppo.old_values": old_values, "ppo.mask": mask,
                "ppo.gae.advantages_raw": adv_raw, "ppo.gae.advantages": adv_white, "ppo.gae.returns": returns,
                "ppo.advantages": adv, "ppo.logp": logp, "ppo.old_logp": old, "ppo.ref_logp": ref,
                "ppo.values": values})
    scalars(out, "ppo", dict(o, gamma=gamma, lam=lam))
    stats, glogp, gvalues = ppo_reference(logp, old, adv, mask, values, old_values, returns, ref, o)
    assert torch.isfinite(glogp).all() and torch.isfinite(gvalues).all()
    assert 0 < stats["clip_frac_lower"] and 0 < stats["vf_clip_frac"] < 1, stats
    out["ppo.grad_logp"], out["ppo.grad_values"] = glogp, gvalues
    scalars(out, "ppo", stats)


# ---------------------------------------------------------------- KL in the reward

def kl_estimate(logp, ref, kind):
    d = logp - ref
    return {"kl": d, "abs": d.abs(), "mse": 0.5 * d * d, "low_var_kl": k3(logp, ref)}[kind]


def make_kl_reward(rng, out):
    N, T, beta = 4, 6, 0.05
    mask = mask_from_lengths([6, 3, 5, 0], T, holes=[(0, 2)])  # row 3 has no response token
    scores = torch.zeros(N, T)
    for i, r in enumerate([1.0, -0.5, 0.25, 0.0]):
        if mask[i].any():
            scores[i, int(mask[i].nonzero().max())] = r
    logp = -torch.rand(N, T, generator=rng) * 2.5 - 0.05
    ref = logp + torch.randn(N, T, generator=rng) * 0.4
    ref[2, 1] = logp[2, 1] + 3.0  # the k3 clamp at 10
    logp = fill_masked(logp, mask, [NAN, 7.0])
    ref = fill_masked(ref, mask, [-math.inf, NAN])
    out.update({"klr.logp": logp, "klr.ref_logp": ref, "klr.mask": mask, "klr.scores": scores})
    scalars(out, "klr", {"beta": beta})
    m = mask.bool()
    for kind in ["kl", "abs", "mse", "low_var_kl"]:
        kld = torch.zeros(N, T)
        kld[m] = kl_estimate(logp[m], ref[m], kind)
        rewards = scores - beta * kld
        per_seq = (kld * mask).sum(-1) / (mask.sum(-1) + 1e-8)  # verl's masked_mean
        out[f"klr.{kind}.penalty"] = kld
        out[f"klr.{kind}.rewards"] = rewards
        scalars(out, f"klr.{kind}", {"kl": per_seq.mean().item()})
    # The adaptive controller over five steps of the "kl" penalty's means.
    value, target, horizon, n = 0.2, 0.1, 50, 8
    trace = []
    for kl in [0.5, 0.02, 0.11, 0.1, -0.3]:
        err = min(max(kl / target - 1, -0.2), 0.2)
        value *= 1 + err * n / horizon
        trace.append(value)
    out["klr.adaptive.kls"] = torch.tensor([0.5, 0.02, 0.11, 0.1, -0.3])
    out["klr.adaptive.values"] = torch.tensor(trace)
    scalars(out, "klr.adaptive", {"start": 0.2, "target": target, "horizon": horizon, "n": n})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--out", default=os.path.join(root, "tests/data/rl/rl_golden.safetensors"))
    args = ap.parse_args()
    rng = torch.Generator().manual_seed(15)
    out = {}
    make_grpo(rng, out)
    make_gspo(rng, out)
    make_dpo(rng, out)
    make_ppo(rng, out)
    make_kl_reward(torch.Generator().manual_seed(16), out)
    make_adv_estimators(out)
    out = {k: v.contiguous() for k, v in out.items()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file(out, args.out, metadata={"generator": "tests/reference/rl/make_rl_golden.py", "torch": torch.__version__})
    print(f"wrote {args.out}: {len(out)} tensors, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
