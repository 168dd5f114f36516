#!/usr/bin/env python3
"""Independent YaRN reference for tests/test_yarn.cpp: writes tests/data/yarn_ref.json.

Written from the YaRN paper (Peng, Quesnelle, Fan, Shippole 2023, arXiv:2309.00071, sec. 3.2
"NTK-by-parts" and 3.4 "YaRN") and transformers' documented `rope_type = "yarn"` parameters
(factor, original_max_position_embeddings, beta_fast = 32, beta_slow = 1, truncate,
mscale / mscale_all_dim), in terms of the paper's quantities rather than any implementation:

  theta_d   = base^(-2d/|D|)                     plain RoPE frequency of pair d
  lambda_d  = 2 pi / theta_d                     its wavelength (tokens per turn)
  r(d)      = L / lambda_d                       turns it makes in the original context L
  pairs with r(d) > beta_fast keep theta_d (extrapolate), pairs with r(d) < beta_slow take
  theta_d / s (interpolate); in between, the blend weight falls linearly in the pair index d
  from the pair where r = beta_fast to the pair where r = beta_slow (those pairs: d(rho) =
  |D|/2 * log_base(L / (2 pi rho)), rounded outwards to whole pairs unless truncate = False,
  clipped to [0, |D| - 1]).
  sqrt(1/t) = 0.1 ln(s) + 1                      the paper's attention temperature (eq. 22),
  applied to cos and sin; DeepSeek's mscale(s, m) = 0.1 m ln(s) + 1 generalises it.

Run: python3 tests/data/yarn_reference.py > tests/data/yarn_ref.json
"""
import json
import math
import struct


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def mscale(s, m=1.0):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def pair_where_turns(rho, dims, base, L):
    # r(d) = L theta_d / (2 pi) = rho  <=>  base^(-2d/dims) = 2 pi rho / L
    return (dims / 2.0) * math.log(L / (2.0 * math.pi * rho)) / math.log(base)


def table(dims, base, s, L, beta_fast, beta_slow, truncate):
    d_fast = pair_where_turns(beta_fast, dims, base, L)
    d_slow = pair_where_turns(beta_slow, dims, base, L)
    if truncate:
        d_fast, d_slow = math.floor(d_fast), math.ceil(d_slow)
    d_fast, d_slow = max(d_fast, 0.0), min(d_slow, dims - 1.0)
    span = max(d_slow - d_fast, 0.001)
    out = []
    for d in range(dims // 2):
        theta = base ** (-2.0 * d / dims)
        keep = 1.0 - min(1.0, max(0.0, (d - d_fast) / span))  # 1: extrapolate, 0: interpolate
        out.append(theta * keep + (theta / s) * (1.0 - keep))
    return out


def case(name, arch, dims, base, s, L, truncate, deepseek=False, log_mul_key=None, attn_key=None,
         beta_fast=32.0, beta_slow=1.0, beta_keys=False):
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": s, "rope.scaling.original_context_length": L,
            "rope.freq_base": base}
    if log_mul_key is not None:
        keys["rope.scaling.yarn_log_multiplier"] = log_mul_key
    if attn_key is not None:
        keys["rope.scaling.attn_factor"] = attn_key
    if beta_keys:
        keys["rope.scaling.yarn_beta_fast"] = beta_fast
        keys["rope.scaling.yarn_beta_slow"] = beta_slow
    A = f32(attn_key) if attn_key is not None else 1.0
    # The file's multiplier (f32): deepseek2's converter writes 0.1 * mscale_all_dim.
    if log_mul_key is None:
        M = 0.0
    elif deepseek:
        M = f32(f32(log_mul_key) / f32(0.1))
    else:
        M = f32(log_mul_key)
    if M != 0:
        m = M if (deepseek and M != 1.0) else 1.0
        attn = A * mscale(s, m) / mscale(s, M)
    else:
        attn = A * mscale(s)
    kq = 1.0
    if deepseek:  # softmax scale *= mscale(s, mscale_all_dim)^2 (times the rope factor)
        kq = (attn * (1.0 + 0.1 * M * math.log(s))) ** 2
    return {"name": name, "arch": arch, "n_rot": dims, "truncate": truncate, "keys": keys,
            "inv_freq": table(dims, base, s, L, beta_fast, beta_slow, truncate), "attn_factor": attn,
            "kq_factor": kq, "plain": [base ** (-2.0 * d / dims) for d in range(dims // 2)],
            "turns": [L * base ** (-2.0 * d / dims) / (2 * math.pi) for d in range(dims // 2)],
            "beta_fast": beta_fast, "beta_slow": beta_slow, "factor": s}


cases = [
    # gpt-oss-120b / 20b config.json: rope_theta 150000, head_dim 64, yarn factor 32, original 4096,
    # beta 32 / 1, truncate false.
    case("gpt-oss-120b", "gpt-oss", 64, 150000.0, 32.0, 4096, False),
    # the tiny gpt-oss fixture's head_dim 32 with a short original context: the ramp falls inside.
    case("gpt-oss-tiny-yarn", "gpt-oss", 32, 150000.0, 4.0, 256, False, beta_keys=True, beta_fast=16.0, beta_slow=2.0),
    # DeepSeek-V3 config.json: qk_rope_head_dim 64, rope_theta 10000, yarn factor 40, original
    # 4096, beta 32 / 1, mscale = mscale_all_dim = 1.0 (converter: yarn_log_multiplier 0.1).
    case("deepseek-v3", "deepseek2", 64, 10000.0, 40.0, 4096, True, deepseek=True, log_mul_key=0.1),
    # DeepSeek-V2-Lite: mscale = mscale_all_dim = 0.707.
    case("deepseek-v2-lite", "deepseek2", 64, 10000.0, 40.0, 4096, True, deepseek=True, log_mul_key=0.0707),
    # the tiny deepseek2 fixture's 16 rope dims, no multiplier key, an extra rope.scaling.attn_factor.
    case("deepseek2-tiny-nolog", "deepseek2", 16, 10000.0, 8.0, 512, True, deepseek=True, attn_key=1.25),
    # another architecture with a multiplier: mscale(s) / mscale(s, M).
    case("gpt-oss-logmul", "gpt-oss", 32, 150000.0, 16.0, 1024, False, log_mul_key=0.5),
]
print(json.dumps({"source": "tests/data/yarn_reference.py", "cases": cases}, indent=1))
