#pragma once
// Quality measurements of a run against the text or against a reference run: perplexity,
// KL divergence from a compact reference file, and the statistics printed with them
// (`strata perplexity`, docs/tools.md). Plain functions over logits, so every formula can be
// checked on hand-computed inputs (tests/test_quality.cpp); only the MoCE calibration at the
// end drives an engine.
//
// Conventions (llama.cpp's tools/perplexity/perplexity.cpp, so numbers are comparable):
//  - the text's tokens are cut into n_chunk = n_tokens / n_ctx chunks of n_ctx tokens (the
//    rest is dropped); each chunk runs from an empty KV cache;
//  - in each chunk only the second half is scored: the logits at positions j in
//    [first, n_ctx - 1) with first = n_ctx / 2 predict token j + 1, so n_ctx - 1 - first
//    tokens per chunk, each with at least first tokens of context;
//  - NLL of a position = -log softmax(logits)[next token]; PPL = exp(mean NLL).
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

namespace strata::quality {

/// Thrown for inputs a quality measurement cannot use: a text shorter than two chunks, a base
/// file that is truncated, corrupt, of another version, or from another text, tokenizer or
/// vocabulary. The message says which and what to do.
class QualityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// How a text of n_tokens is cut and scored with chunks of n_ctx tokens.
struct ChunkPlan {
  int n_ctx = 0;     ///< tokens per chunk
  int n_chunk = 0;   ///< n_tokens / n_ctx (llama.cpp needs at least 2)
  int first = 0;     ///< n_ctx / 2: the first position whose logits are scored
  int n_scored = 0;  ///< n_ctx - 1 - first scored positions per chunk
};
/// The llama.cpp plan. Throws QualityError when n_ctx < 4 or n_tokens < 2 * n_ctx (naming
/// both counts, as llama-perplexity refuses such a text).
ChunkPlan plan_chunks(size_t n_tokens, int n_ctx);

/// Mean of n samples given their sum and sum of squares, and its standard error
/// sqrt((sum2/n - mean^2) / (n - 1)) (the population variance over n - 1, as llama.cpp
/// computes it; equal to the sample standard deviation / sqrt(n)). error = 0 when n < 2 or the
/// variance rounds to <= 0.
struct MeanError {
  double mean = 0;
  double error = 0;
};
MeanError mean_and_error(double sum, double sum2, size_t n);

/// The `fraction` quantile (0..1) of ascending `sorted` by linear interpolation between the
/// two closest ranks, rank = fraction * (n - 1) (numpy's default "linear" method, the one
/// llama.cpp uses). Throws std::invalid_argument on an empty input.
double percentile(std::span<const double> sorted, double fraction);

/// log(sum_i exp(row[i])) in double: max in float, sum of exp(row[i] - max) in index order.
double log_sum_exp(const float* row, int n_vocab);
/// The log-probability of a logit as stored and compared everywhere: float(logit - lse). One
/// definition so that a run compared with its own base gives exactly 0.
inline float log_prob(float logit, double lse) { return float(double(logit) - lse); }

/// What the base file keeps of one scored position of the reference run P:
///  - lse: log-sum-exp of its logits (nats; logits = log-probs + lse);
///  - ids/lp: the K most probable token ids by descending logit (ties: lower id first) and
///    their log-probs log P(i) (float, log_prob above);
///  - tail: P's mass outside those K ids, sum_{i not in top K} P(i), summed in double over the
///    full distribution (not 1 - sum of the K: that would lose everything below 1e-7);
///  - next_lp: log P(next), the log-prob of the text's next token (in top K or not), for PPL(base)
///    and Δp of the text token.
struct RefPosition {
  double lse = 0;
  double tail = 0;
  float next_lp = 0;
  std::vector<int32_t> ids;
  std::vector<float> lp;
};
/// The record of one position from its full logits. K in [1, n_vocab]; next_id in [0, n_vocab).
RefPosition make_ref(const float* row, int n_vocab, int top_k, int32_t next_id);

/// One position of a run Q compared with its reference P.
///  kld: KL(P || Q) over the K + 1 bins {top-K ids of P, everything else}:
///         sum_{i in S} P(i) (log P(i) - log Q(i)) + P_T log(P_T / Q_T),
///       P_T = P's tail, Q_T = Q's mass outside S. By the log-sum inequality the true tail
///       term sum_{i not in S} P(i) log(P(i)/Q(i)) >= P_T log(P_T/Q_T), so this is a LOWER
///       bound of the true KL(P||Q), exact when K = n_vocab (tail empty). It is the KLD reported.
///  kld_upper: an UPPER bound: the exact S part plus the largest tail term any distribution
///       consistent with what was stored can give: every tail P(i) is at most P(K-th id) (it
///       is not in the top K) and they sum to P_T; the term is convex in P, so its maximum puts
///       P(K-th) on the tail ids of smallest Q(i), the remainder on the next.
///  nll, nll_base: -log Q(next), -next_lp.  same_top: Q's argmax (lower id on ties) == P's top id.
///  dp_text: Q(next) - P(next) (llama.cpp's Δp);  dp_top: Q(top) - P(top) for P's top-1 id.
struct PositionCompare {
  double kld = 0;
  double kld_upper = 0;
  double nll = 0;
  double nll_base = 0;
  bool same_top = false;
  double dp_text = 0;
  double dp_top = 0;
  double tail = 0;  ///< P's mass outside its top K (what the bounds are about)
};
PositionCompare compare_position(const RefPosition& ref, const float* row, int n_vocab, int32_t next_id);

/// Perplexity over a set of NLLs: PPL = exp(mean), error = PPL * SE(mean NLL) (first-order
/// propagation through exp, as llama.cpp prints "PPL = x +/- y").
struct PplAccumulator {
  double sum = 0, sum2 = 0;
  size_t n = 0;
  void add(double nll) {
    sum += nll;
    sum2 += nll * nll;
    ++n;
  }
  MeanError nll() const { return mean_and_error(sum, sum2, n); }
  double ppl() const { return n ? std::exp(sum / double(n)) : 0.0; }
  double ppl_error() const { return ppl() * nll().error; }
};

/// The summary `strata perplexity --kl-divergence` prints (all over the scored positions).
struct KldSummary {
  size_t n = 0;
  MeanError ppl, ppl_base;    ///< PPL(Q), PPL(P) with their errors (as PplAccumulator)
  MeanError ppl_ratio;        ///< exp(mean(nll - nll_base)), error ratio * SE(mean difference)
  MeanError kld;              ///< mean lower-bound KLD and its SE
  double kld_upper_mean = 0;  ///< mean of kld_upper (the gap to kld is what top-K can not see)
  double tail_mean = 0;       ///< mean of P's tail mass
  double kld_p99 = 0, kld_p999 = 0, kld_max = 0, kld_median = 0;
  MeanError same_top;     ///< fraction p, error sqrt(p (1 - p) / (n - 1))
  MeanError rms_dp_text;  ///< sqrt(mean dp^2), error 0.5 / rms * SE(mean dp^2)
  MeanError rms_dp_top;
};
KldSummary summarize(std::span<const PositionCompare> positions);

/// The reference run, as `--kl-divergence-base FILE` writes it (format in docs/tools.md):
/// version, vocabulary size, K, chunk plan, a hash of the tokenizer, the model file and
/// settings it came from, every evaluated token, then one RefPosition per scored position
/// (n_chunk * n_scored, chunk by chunk), and a 64-bit FNV-1a checksum of all preceding bytes.
struct KldBase {
  static constexpr uint32_t kVersion = 1;
  uint32_t n_vocab = 0;
  uint32_t top_k = 0;
  ChunkPlan plan;
  uint64_t tokenizer_hash = 0;
  std::string model;            ///< the reference model file (as given)
  std::string settings;         ///< the reference engine settings, for the report (e.g. "act-quant f32, kernels avx2")
  std::vector<int32_t> tokens;  ///< n_chunk * n_ctx: the tokens the chunks ran
  std::vector<RefPosition> positions;
};
/// Writes `base` to `path` (via path.tmp, renamed when complete). Throws QualityError when
/// the file can not be written or the sizes are inconsistent.
void write_kld_base(const std::string& path, const KldBase& base);
/// Reads and validates a base file. Throws QualityError naming the problem: not a base file
/// (magic), another version, truncated (expected vs actual bytes), corrupt (checksum).
KldBase read_kld_base(const std::string& path);

/// 64-bit FNV-1a of n bytes, continuing from h.
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull);
/// A tokenizer's identity: FNV-1a over the pre-tokenizer name, then every token's bytes and
/// type in id order. Two tokenizers that can encode a text differently hash differently.
uint64_t tokenizer_hash(const tokenizer::Tokenizer& tok);

// ---- MoCE calibration (--moce-kld-budget; docs/tools.md, "MoCE") ----

/// The prompt of the built-in samples (the model's own text after it).
inline constexpr const char* kMoceCalibrationPrompt = "def fibonacci(n):";

/// Exact KL(p || q) = sum_i p_i (log p_i - log q_i) in nats of each row of log-probabilities
/// p_log, q_log ([n][n_vocab], n_vocab contiguous; both log-softmax), summed in double over the
/// whole vocabulary in index order; a row that rounds below 0 gives 0. Returns n values.
/// Throws std::invalid_argument on mismatched sizes or rows that are not whole.
std::vector<double> kld_per_row(std::span<const float> p_log, std::span<const float> q_log, int n_vocab);
/// The mean of kld_per_row (0 for no rows). Throws as kld_per_row.
double mean_kld_rows(std::span<const float> p_log, std::span<const float> q_log, int n_vocab);

/// The mean of per-token values pooled over several sequences (`values[s][t]`), and its standard
/// error by batch means: each sequence is cut into consecutive blocks of `block` tokens (a last
/// partial block counts in the mean, not in the error), error = sd(block means) / sqrt(blocks)
/// (0 with fewer than 2 blocks). Blocks because a token's KLD is not independent of its
/// neighbours' (a substitution changes what stays resident for the next tokens, and the KV cache
/// carries it), so the per-token standard error would understate the uncertainty. Throws
/// std::invalid_argument for block < 1.
MeanError block_mean_error(std::span<const std::vector<double>> values, int block);

/// A grid point of the calibration: the bonus and its teacher-forced KLD vs bonus 0 (nats).
struct MoceGridPoint {
  float bonus = 0;
  double kld = 0;        ///< mean per-token KLD over every calibration token
  double kld_error = 0;  ///< its standard error (block_mean_error with kMoceBlock)
  double kld_bound = 0;  ///< kld + kMoceZ * kld_error: what is compared with the budget
  uint64_t misses = 0;   ///< decode misses of the run, summed over the sequences
};
struct MoceCalibration {
  float bonus = 0;         ///< the chosen bonus (0 if even the smallest grid point fails)
  double kld = 0;          ///< its mean KLD (0 for bonus 0)
  double kld_bound = 0;    ///< its upper bound kld + kMoceZ * error (0 for bonus 0)
  size_t sequences = 0;    ///< calibration sequences (each from an empty arena)
  size_t tokens = 0;       ///< calibration tokens over all sequences
  std::vector<MoceGridPoint> grid;  ///< the points measured, ascending (the search stops at the first failure)
};

/// Log-softmax rows of `tokens` fed one at a time through Engine::decode on a fresh sequence
/// (teacher forcing), at the engine's current bonus, from an empty arena ([n][n_vocab]).
/// Throws EngineError as decode does (e.g. more tokens than the context).
std::vector<float> teacher_forced_logprobs(engine::Engine& eng, std::span<const int32_t> tokens);

/// `n` greedy tokens after kMoceCalibrationPrompt at bonus 0 (prompt included, at most the context).
/// moce-bench's default text; not the calibration sample (greedy text is more certain than real
/// text, so its KLD understates the bonus's: docs/tools.md, "MoCE").
std::vector<int32_t> moce_builtin_sample(engine::Engine& eng, int n);

/// Seeds of the built-in calibration sample: sequence i is drawn with seed kMoceSampleSeed + i.
inline constexpr uint64_t kMoceSampleSeed = 1;
/// The built-in calibration sample: kMoceSampleSequences sequences of kMoceSampleTokens tokens.
inline constexpr int kMoceSampleSequences = 4;
inline constexpr int kMoceSampleTokens = 64;

/// `n_seq` sequences of the model's own text after kMoceCalibrationPrompt, `n` tokens each
/// (prompt included; at most the context), sampled at temperature 1 from the full distribution
/// (no top-k, top-p, min-p or repetition penalty: text distributed as the model predicts it, so as
/// uncertain as the model is on real text) with seeds kMoceSampleSeed + i, at bonus 0 from an
/// empty arena. The same tokens for a model on every run (the draw is std::mt19937_64's). Leaves
/// the engine's bonus as it was and its arena empty. Throws EngineError as decode does.
std::vector<std::vector<int32_t>> moce_sampled_texts(engine::Engine& eng, int n_seq, int n);

/// The criterion: a bonus keeps the budget when mean + kMoceZ * standard error <= budget, the
/// standard error from blocks of kMoceBlock tokens (block_mean_error). kMoceZ = 1.645 is the
/// one-sided 95 % normal quantile: the bound is exceeded by the true mean KLD (on text like the
/// sample) about 1 time in 20.
inline constexpr double kMoceZ = 1.645;
inline constexpr int kMoceBlock = 16;

/// Grid search over kMoceGrid (ascending) for the largest bonus that keeps the budget with every
/// smaller grid bonus keeping it too: each point teacher-forces every sequence of `texts` from an
/// empty arena (each sequence is its own residency history) and compares it with bonus 0 over the
/// full vocabulary; the search stops at the first point whose bound exceeds the budget (the KLD is
/// not monotone in the bonus, so a larger bonus that passes after a failure is taken for luck).
/// Leaves the engine at the chosen bonus, its arena empty and its counters reset. Throws
/// std::invalid_argument for a budget that is not > 0 and finite, texts that are empty, hold a
/// sequence of fewer than 2 tokens or fewer than 2 whole blocks of kMoceBlock tokens in all (no
/// standard error), EngineError as decode does.
MoceCalibration calibrate_moce(engine::Engine& eng, std::span<const std::vector<int32_t>> texts, double budget);
inline constexpr float kMoceGrid[] = {0.025f, 0.05f, 0.1f, 0.15f, 0.25f, 0.35f, 0.5f, 0.65f, 0.85f, 1.0f};

}  // namespace strata::quality
