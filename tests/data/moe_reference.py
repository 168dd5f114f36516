#!/usr/bin/env python3
"""Independent reference forward for tests/test_mixtral.cpp and tests/test_minimax_m2.cpp
(python3 standard library only).

Reads an all-F32 GGUF of general.architecture "llama" with routed experts (Mixtral) or
"minimax-m2" and prints teacher-forced logits for every position as JSON:
{"logits": [[...], ...]}. Mixtral is written from the
published architecture (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088: a Mistral
decoder whose FFN is a top-2 mixture of SwiGLU experts, gate = softmax over the top-k router
logits) and from GGUF's documented layout (ggml ne order: ne[0] contiguous; llama.cpp's "NORM"
RoPE for this architecture, rotating adjacent pairs (2i, 2i+1) by pos * base^(-2i/n_rot)).
MiniMax-M2 is written from its Hugging Face model card and config (MiniMaxAI/MiniMax-M2:
qk_norm_type "per_layer" = one RMSNorm over the whole q (and k) projection before the split
into heads, rotary_dim < head_dim = NEOX rotation of the first rotary_dim dims of each head,
pairing dim i with i + rotary_dim/2; scoring_func sigmoid with use_routing_bias = the bias is
added to the sigmoid scores to choose the top-k, the chosen experts' unbiased scores are the
weights, normalized to sum 1) and llama.cpp's GGUF names for it (attn_q_norm, attn_k_norm,
exp_probs_b.bias). Nothing here comes from strata's code. All arithmetic in Python floats
(double).

Usage: moe_reference.py MODEL.gguf 1,2,3,... [--per-head-qk-norm]
  --per-head-qk-norm: a deliberately wrong MiniMax-M2 (q/k normed per head, each head with its
  slice of the weights), for the test to show that its tolerance tells the two apart.
"""
import json
import math
import struct
import sys

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class Reader:
    def __init__(self, data):
        self.d, self.o = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.d, self.o)[0]
        self.o += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.d[self.o:self.o + n].decode("utf-8", "replace")
        self.o += n
        return s

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("<I"), self.take("<Q")
            return [self.value(et) for _ in range(n)]
        return self.take(SCALAR[t])


def read_gguf(path):
    data = open(path, "rb").read()
    r = Reader(data)
    assert r.take("<I") == 0x46554747, "not a GGUF file"
    r.take("<I")  # version
    n_t, n_kv = r.take("<Q"), r.take("<Q")
    kv = {}
    for _ in range(n_kv):
        k = r.string()
        kv[k] = r.value(r.take("<I"))
    infos = []
    for _ in range(n_t):
        name = r.string()
        nd = r.take("<I")
        ne = [r.take("<Q") for _ in range(nd)]
        typ, off = r.take("<I"), r.take("<Q")
        infos.append((name, ne, typ, off))
    align = kv.get("general.alignment", 32)
    base = (r.o + align - 1) // align * align
    tensors = {}
    for name, ne, typ, off in infos:
        assert typ == 0, f"{name}: only F32 tensors (type {typ})"
        n = 1
        for x in ne:
            n *= x
        tensors[name] = (ne, struct.unpack_from(f"<{n}f", data, base + off))
    return kv, tensors


def rows(t, first, count, width):
    """Rows first..first+count-1 of a tensor whose rows have `width` contiguous elements."""
    flat = t[1]
    return [flat[(first + i) * width:(first + i + 1) * width] for i in range(count)]


def matvec(rs, x):
    return [math.fsum(a * b for a, b in zip(r, x)) for r in rs]


def rmsnorm(x, w, eps):
    s = 1.0 / math.sqrt(math.fsum(v * v for v in x) / len(x) + eps)
    return [v * s * g for v, g in zip(x, w)]


def softmax(z):
    m = max(z)
    e = [math.exp(v - m) for v in z]
    s = math.fsum(e)
    return [v / s for v in e]


def main():
    kv, T = read_gguf(sys.argv[1])
    ids = [int(x) for x in sys.argv[2].split(",")]
    per_head_qk = "--per-head-qk-norm" in sys.argv[3:]
    a = kv["general.architecture"]
    mm = a == "minimax-m2"
    L, E = kv[a + ".block_count"], kv[a + ".embedding_length"]
    H, HK = kv[a + ".attention.head_count"], kv[a + ".attention.head_count_kv"]
    hd = kv.get(a + ".attention.key_length", E // H)
    n_rot = kv.get(a + ".rope.dimension_count", hd)
    base = kv.get(a + ".rope.freq_base", 10000.0)
    eps = kv[a + ".attention.layer_norm_rms_epsilon"]
    X, K = kv[a + ".expert_count"], kv[a + ".expert_used_count"]
    F = kv.get(a + ".expert_feed_forward_length") or kv[a + ".feed_forward_length"]
    V = T["token_embd.weight"][0][1]
    out_w = T.get("output.weight", T["token_embd.weight"])
    out_rows = rows(out_w, 0, V, E)
    blk = lambda l, n: T[f"blk.{l}.{n}"]
    W = []
    for l in range(L):
        W.append({
            "an": blk(l, "attn_norm.weight")[1], "fn": blk(l, "ffn_norm.weight")[1],
            "q": rows(blk(l, "attn_q.weight"), 0, H * hd, E), "k": rows(blk(l, "attn_k.weight"), 0, HK * hd, E),
            "v": rows(blk(l, "attn_v.weight"), 0, HK * hd, E), "o": rows(blk(l, "attn_output.weight"), 0, E, H * hd),
            "r": rows(blk(l, "ffn_gate_inp.weight"), 0, X, E),
            "g": [rows(blk(l, "ffn_gate_exps.weight"), j * F, F, E) for j in range(X)],
            "u": [rows(blk(l, "ffn_up_exps.weight"), j * F, F, E) for j in range(X)],
            "d": [rows(blk(l, "ffn_down_exps.weight"), j * E, E, F) for j in range(X)],
        })
        if mm:
            W[-1]["qn"], W[-1]["kn"] = blk(l, "attn_q_norm.weight")[1], blk(l, "attn_k_norm.weight")[1]
            W[-1]["sb"] = blk(l, "exp_probs_b.bias")[1]
    cache = [([], []) for _ in range(L)]
    result = []
    for pos, tok in enumerate(ids):
        x = list(rows(T["token_embd.weight"], tok, 1, E)[0])
        for l in range(L):
            w = W[l]
            h = rmsnorm(x, w["an"], eps)
            q, k, v = matvec(w["q"], h), matvec(w["k"], h), matvec(w["v"], h)
            if mm and not per_head_qk:
                q, k = rmsnorm(q, w["qn"], eps), rmsnorm(k, w["kn"], eps)
            elif mm:
                q = sum((rmsnorm(q[i * hd:(i + 1) * hd], w["qn"][i * hd:(i + 1) * hd], eps) for i in range(H)), [])
                k = sum((rmsnorm(k[i * hd:(i + 1) * hd], w["kn"][i * hd:(i + 1) * hd], eps) for i in range(HK)), [])
            for vec, nh in ((q, H), (k, HK)):
                for hh in range(nh):
                    for i in range(n_rot // 2):
                        th = pos * base ** (-2.0 * i / n_rot)
                        c, s = math.cos(th), math.sin(th)
                        if mm:  # NEOX: dim i with dim i + n_rot/2
                            j0, j1 = hh * hd + i, hh * hd + i + n_rot // 2
                        else:  # NORM: adjacent pairs
                            j0, j1 = hh * hd + 2 * i, hh * hd + 2 * i + 1
                        x0, x1 = vec[j0], vec[j1]
                        vec[j0], vec[j1] = x0 * c - x1 * s, x1 * c + x0 * s
            cache[l][0].append(k)
            cache[l][1].append(v)
            att = []
            for hh in range(H):
                g = hh // (H // HK)
                qh = q[hh * hd:(hh + 1) * hd]
                sc = [math.fsum(a_ * b_ for a_, b_ in zip(qh, kk[g * hd:(g + 1) * hd])) / math.sqrt(hd)
                      for kk in cache[l][0]]
                p = softmax(sc)
                att += [math.fsum(p[s] * cache[l][1][s][g * hd + d] for s in range(len(p))) for d in range(hd)]
            x = [a_ + b_ for a_, b_ in zip(x, matvec(w["o"], att))]
            h = rmsnorm(x, w["fn"], eps)
            logits = matvec(w["r"], h)
            if mm:
                score = [1.0 / (1.0 + math.exp(-z)) for z in logits]
                choice = [sc_ + b_ for sc_, b_ in zip(score, w["sb"])]
                top = sorted(range(X), key=lambda j: (-choice[j], j))[:K]
                tot = math.fsum(score[j] for j in top)
                gate = [score[j] / tot for j in top]
            else:
                top = sorted(range(X), key=lambda j: (-logits[j], j))[:K]
                gate = softmax([logits[j] for j in top])  # = softmax over all, renormalized over the k
            y = [0.0] * E
            for j, gw in zip(top, gate):
                act = [gg / (1.0 + math.exp(-gg)) * uu for gg, uu in zip(matvec(w["g"][j], h), matvec(w["u"][j], h))]
                y = [a_ + gw * b_ for a_, b_ in zip(y, matvec(w["d"][j], act))]
            x = [a_ + b_ for a_, b_ in zip(x, y)]
        h = rmsnorm(x, T["output_norm.weight"][1], eps)
        result.append(matvec(out_rows, h))
    json.dump({"logits": result}, sys.stdout)


if __name__ == "__main__":
    main()
